/** The JSON of GET /hub/api/gpulab/admin/overview (gpulab.hub.apihandlers.admin). */

export type Kind = 'server' | 'job' | 'dask';
export type Tier = 'on-demand' | 'preemptible';

export interface Device {
  uuid: string;
  index: number | null;
  model: string | null;
  mig_profile: string | null;
  milli: number;
  fraction: number;
}

export interface ServerInfo {
  name: string;
  url: string;
  last_activity: string | null;
}

export interface Workload {
  id: string;
  kind: Kind;
  owner: string;
  groups: string[];
  profile: string | null;
  gpu_model: string | null;
  mig_profile: string | null;
  /** GPUs held in all, e.g. 0.25 or 2 */
  gpus: number;
  devices: Device[];
  node: string;
  tier: Tier;
  over_quota: boolean;
  started_at: string | null;
  server: ServerInfo | null;
  ui_idle_seconds: number | null;
  /** null until the metrics service's figures are joined in */
  gpu_idle_seconds: number | null;
  /** whether a GPU monitor measures it (servers); jobs and Dask workers push no figures yet */
  monitored: boolean;
  utilization: number | null;
  memory_used_mib: number | null;
  live: unknown;
  /** the GPU-aware culler's latest decision on a server (absent or null: not judged) */
  culling?: CullingState | null;
}

export interface CullingState {
  verdict: 'keep' | 'exempt' | 'warn' | 'wait' | 'cull';
  reason: string;
  /** seconds since the epoch when a warning runs out */
  deadline: number | null;
  dry_run: boolean;
}

export interface Share {
  id: string;
  owner: string;
  milli: number;
}

export interface NodeGpu {
  uuid: string;
  index: number;
  model: string;
  mig_profile: string | null;
  memory_mib: number;
  capacity_milli: number;
  shares: Share[];
}

export interface NodeInfo {
  name: string;
  gpus: NodeGpu[];
}

export interface Overview {
  generated_at: string;
  inventory: string;
  workloads: Workload[];
  nodes: NodeInfo[];
}

export type Action = 'stop' | 'preempt';

export interface ActionResult {
  id: string;
  ok: boolean;
  message: string;
}
