import { Token } from '@lumino/coreutils';
import { MonitorModel } from './model';

/** The GPU monitor, for other gpulab plugins (status bar, later panels). */
export interface IGpuMonitor {
  readonly model: MonitorModel;
  /** Open (or reveal) the panel. */
  open(): void;
}

export const IGpuMonitor = new Token<IGpuMonitor>(
  'jupyterlab-gpulab:IGpuMonitor',
  "gpulab's GPU monitor: the share's live figures, rules and alerts"
);

export namespace CommandIDs {
  export const open = 'gpulab:open-gpu-monitor';
}
