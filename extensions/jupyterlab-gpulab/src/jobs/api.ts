/**
 * The server extension's jobs API (under `<base_url>/gpulab/jobs/`): the owner's GPU job runs,
 * which the server fetches from the hub with its own token (the page holds no hub token).
 */
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IAttempt {
  number: number;
  state: string;
  node: string;
  gpus: string;
  started_at: number | null;
  ended_at: number | null;
  exit_code: number | null;
  reason: string;
  /** it failed before the job's code started: retried without counting against max_retries */
  platform_failure?: boolean;
}

export interface IRun {
  id: number;
  state: string;
  reason: string;
  /** its attempt ended and it will run again (a retry waiting out its back-off) */
  retrying?: boolean;
  submitted_at: number;
  updated_at: number;
  queue_position?: number | null;
  waiting_reason?: string | null;
  spec: { name: string; kind: string; path: string; profile: string; output_dir: string };
  attempts: IAttempt[];
  outputs?: { path: string; size_bytes: number }[];
  /** added by the server: one line for people, outputs as paths in this server, TensorBoard */
  status_message: string;
  output_paths: string[];
  tensorboard_url: string;
}

/** States a run can still leave (the hub queues a preempted run again). */
export const ACTIVE_STATES = new Set(['queued', 'admitted', 'running', 'preempted']);

/** Whether the run may still change: an active state, or an ended attempt whose retry waits. */
export function isActive(run: Pick<IRun, 'state' | 'retrying'>): boolean {
  return ACTIVE_STATES.has(run.state) || run.retrying === true;
}

async function call<T>(path: string, init: RequestInit = {}): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'gpulab/jobs', path);
  const response = await ServerConnection.makeRequest(url, init, settings);
  const text = await response.text();
  const body = text ? JSON.parse(text) : {};
  if (!response.ok) {
    throw new Error(body.message || `${response.status} ${response.statusText}`);
  }
  return body as T;
}

export async function listRuns(): Promise<IRun[]> {
  return (await call<{ runs: IRun[] }>('')).runs;
}

export async function getRun(id: number): Promise<IRun> {
  return call<IRun>(String(id));
}

export async function cancelRun(id: number): Promise<IRun> {
  return call<IRun>(String(id), { method: 'DELETE' });
}

export async function rerun(id: number): Promise<IRun> {
  return call<IRun>(`${id}/rerun`, { method: 'POST' });
}

/**
 * The run's live log (Server-Sent Events; the browser resumes with Last-Event-ID by itself).
 * EventSource cannot send the X-XSRFToken header JupyterLab's requests carry, and JupyterHub's
 * servers check XSRF on every cookie-authenticated fetch, GETs included: the token goes in the
 * query, as `_xsrf`, which the check also reads.
 */
export function logStreamUrl(id: number, stream: 'stdout' | 'stderr' = 'stdout'): string {
  const query = URLExt.objectToQueryString({ stream, _xsrf: xsrfCookie() });
  return URLExt.join(PageConfig.getBaseUrl(), 'gpulab/jobs', `${id}/logs/stream`) + query;
}

/** The `_xsrf` cookie as JupyterLab's own requests send it: the last one listed (see
 * ServerConnection: tornado keeps the last of duplicate cookies). */
function xsrfCookie(): string {
  let value = '';
  for (const part of document.cookie.split(';')) {
    const trimmed = part.trim();
    if (trimmed.startsWith('_xsrf=')) {
      value = trimmed.substring('_xsrf='.length);
    }
  }
  return value;
}

export interface IProfileChoice {
  slug: string;
  /** `gpu-quarter | 1/4 GPU - 3 free now` */
  label: string;
  /** whether it gives a GPU (the dialog opens on the first that does) */
  gpu: boolean;
  /** why a job or a Dask cluster of it would be refused if submitted now ('' for none) */
  refused: { job: string; dask: string };
}

/**
 * The profile picker of the job and Dask dialogs, marked as the spawn picker marks its list: a
 * profile a submission of `kind` would be refused for is disabled (it cannot be picked), with the
 * reason in its label and title. Opens on the first GPU profile that may be picked (else the
 * first that may be).
 */
export function profileSelect(
  profiles: IProfileChoice[],
  kind: 'job' | 'dask',
  testId: string
): HTMLSelectElement {
  const select = document.createElement('select');
  select.className = 'jp-mod-styled';
  select.dataset.testid = testId;
  for (const p of profiles) {
    const refused = p.refused?.[kind] ?? '';
    const option = new Option(refused ? `${p.label} (${refused})` : p.label, p.slug);
    option.disabled = refused !== '';
    option.title = refused;
    option.dataset.refused = refused;
    select.append(option);
  }
  const open = profiles.filter(p => !(p.refused?.[kind] ?? ''));
  const first = open.find(p => p.gpu) ?? open[0];
  if (first) {
    select.value = first.slug;
  }
  return select;
}

export async function listProfiles(): Promise<{
  quota: string | null;
  profiles: IProfileChoice[];
}> {
  return call('profiles');
}

/** Submit a file of this server (a script with `args`, or a notebook) on `profile`. */
export async function submitFile(body: {
  path: string;
  profile: string;
  args?: string[];
}): Promise<IRun> {
  return call<IRun>('', { method: 'POST', body: JSON.stringify(body) });
}
