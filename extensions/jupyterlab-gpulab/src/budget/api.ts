/**
 * The owner's GPU-hour budget (`<base_url>/gpulab/budget`): the server asks the hub with its own
 * token, so the page never holds one. Shown in the job form and the GPU panel; nothing is shown
 * when no budget binds the user.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface IBudget {
  scope: 'user' | 'group';
  name: string;
  limit_gpu_hours: number;
  allocated_gpu_hours: number;
  remaining_gpu_hours: number;
  state: 'ok' | 'warn' | 'exhausted';
  window_days: number;
}

export interface IBudgetReply {
  /** the tightest budget binding the user; null when none does */
  budget: IBudget | null;
  /** `GPU-hours left: 12.5 of 100 (30 days)` */
  line: string | null;
}

export async function fetchBudget(): Promise<IBudgetReply> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'gpulab/budget');
  const response = await ServerConnection.makeRequest(url, {}, settings);
  const text = await response.text();
  const body = text ? JSON.parse(text) : {};
  if (!response.ok) {
    throw new Error(body.message || `${response.status} ${response.statusText}`);
  }
  return body as IBudgetReply;
}

/** Show `reply`'s line in `node` (hidden when no budget binds the user or it could not be read). */
export function showBudget(node: HTMLElement, reply: IBudgetReply | null): void {
  const budget = reply?.budget ?? null;
  node.textContent = budget ? (reply?.line ?? '') : '';
  node.hidden = budget === null;
  node.dataset.state = budget?.state ?? '';
  node.classList.add('gpulab-budget');
  for (const state of ['ok', 'warn', 'exhausted']) {
    node.classList.toggle(`gpulab-budget-${state}`, budget?.state === state);
  }
}
