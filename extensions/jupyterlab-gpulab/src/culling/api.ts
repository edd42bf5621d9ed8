/**
 * The server extension's culling API (under `<base_url>/gpulab/culling/`): the hub's warning
 * for this server, the user's real input, and her answers to a warning.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** What a person did; nothing else is input (see jupyterlab_gpulab/culling.py). */
export type InputKind = 'ui-input' | 'kernel-execute' | 'terminal-input';

export interface ICullWarning {
  /** Unix time (s) when the warning runs out. */
  deadline: number;
  seconds_left: number;
  action: 'stop' | 'checkpoint-stop' | 'downsize';
  reason: string;
  keep_alive_seconds: number;
  /** The CPU-only profile's name, or null when the catalog has none. */
  switch_to_cpu: string | null;
}

/** The user's GPU-hour budget past its warning share, or used up (the hub's sentence). */
export interface IBudgetNotice {
  state: 'warn' | 'exhausted';
  message: string;
}

export interface ICullingState {
  reporting: boolean;
  culling: boolean;
  warning: ICullWarning | null;
  budget_notice: IBudgetNotice | null;
  poll_seconds: number;
  last_input_seconds_ago: number | null;
}

const NAMESPACE = 'gpulab/culling';

export class CullingAPI {
  constructor(readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings()) {}

  async state(): Promise<ICullingState> {
    return (await this._request('', 'GET')) as ICullingState;
  }

  async input(kind: InputKind): Promise<void> {
    await this._request('input', 'POST', { kind });
  }

  async keepAlive(): Promise<ICullingState> {
    return (await this._request('keep-alive', 'POST', {})) as ICullingState;
  }

  async switchToCpu(): Promise<string> {
    const reply = await this._request('switch-to-cpu', 'POST', {});
    return String(reply.message ?? '');
  }

  private async _request(path: string, method: string, body?: unknown): Promise<any> {
    const url = URLExt.join(this.settings.baseUrl, NAMESPACE, path);
    const init: RequestInit = { method };
    if (body !== undefined) {
      init.body = JSON.stringify(body);
    }
    const response = await ServerConnection.makeRequest(url, init, this.settings);
    const text = await response.text();
    let reply: any = {};
    try {
      reply = text ? JSON.parse(text) : {};
    } catch {
      reply = { message: text.slice(0, 300) };
    }
    if (!response.ok) {
      throw new Error(`${response.status} ${reply.message ?? response.statusText}`);
    }
    return reply;
  }
}
