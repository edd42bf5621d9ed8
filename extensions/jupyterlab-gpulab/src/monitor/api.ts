/**
 * The server extension's monitor API (under `<base_url>/gpulab/monitor/`): types and calls.
 *
 * Every call goes through `ServerConnection`, so the token and the `_xsrf` cookie are sent the
 * way JupyterLab's own services send them, behind JupyterHub or not.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export type Source = 'nvml' | 'simulated' | 'none';

export interface IShare {
  profile: string;
  fraction: number | null;
  enforcement: string;
}

export interface IDeviceInfo {
  uuid: string;
  name: string;
  index: number;
  mig: boolean;
  whole: boolean;
  memory_total_mib: number;
  memory_limit_mib: number;
}

export interface IDevicesReply {
  source: Source;
  simulated: boolean;
  message: string;
  period_seconds: number;
  max_rate_hz: number;
  share: IShare;
  devices: IDeviceInfo[];
}

export interface IProcess {
  pid: number;
  memory_mib: number;
  own: boolean;
  name: string;
}

export interface IDeviceSample {
  utilization_pct: number | null;
  memory_used_mib: number;
  memory_limit_mib: number;
  temperature_c: number | null;
  power_w: number | null;
  processes: IProcess[];
}

export interface ISample {
  /** Unix time in seconds. */
  t: number;
  devices: { [uuid: string]: IDeviceSample };
}

export interface IRule {
  id: string;
  text: string;
  name: string;
  severity: string;
  source: 'user' | 'default';
}

export interface IRulesReply {
  rules: IRule[];
  prometheus?: { [key: string]: unknown };
  /** Why rules are unavailable or some were not loaded (e.g. a broken rules file). */
  error?: string;
}

export interface IAlertEvent {
  rule: string;
  severity: string;
  message: string;
  device: string;
  state: 'firing' | 'resolved';
  since: number;
  t: number;
}

export interface IAlertsReply {
  active: IAlertEvent[];
  recent: IAlertEvent[];
}

/** What the websocket sends. */
export type StreamMessage =
  | ({ type: 'hello'; rate_hz: number } & IDevicesReply)
  | { type: 'sample'; sample: ISample }
  | { type: 'alert'; event: IAlertEvent };

/** A rule the server refused, with where in its text the problem is (1-based). */
export class RuleError extends Error {
  constructor(
    message: string,
    readonly line: number | null,
    readonly column: number | null
  ) {
    super(message);
  }
}

/** A reply other than the one expected; `status` is the HTTP status (0: no reply). */
export class MonitorAPIError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

const NAMESPACE = 'gpulab/monitor';

export class MonitorAPI {
  constructor(readonly settings: ServerConnection.ISettings = ServerConnection.makeSettings()) {}

  devices(): Promise<IDevicesReply> {
    return this._json<IDevicesReply>('devices');
  }

  async samples(since: number): Promise<ISample[]> {
    const reply = await this._json<{ samples: ISample[] }>(
      'samples?since=' + encodeURIComponent(since.toFixed(3))
    );
    return reply.samples;
  }

  rules(): Promise<IRulesReply> {
    return this._json<IRulesReply>('rules');
  }

  alerts(): Promise<IAlertsReply> {
    return this._json<IAlertsReply>('alerts');
  }

  /** Add a rule; a rule the server cannot parse rejects with a `RuleError`. */
  async addRule(text: string): Promise<IRule> {
    const response = await this._fetch('rules', {
      method: 'POST',
      body: JSON.stringify({ text })
    });
    const body = await readJSON(response);
    if (response.status === 400) {
      throw new RuleError(
        String(body.message ?? 'the rule was refused'),
        typeof body.line === 'number' ? body.line : null,
        typeof body.column === 'number' ? body.column : null
      );
    }
    if (!response.ok) {
      throw errorFrom(response, body);
    }
    return body.rule as IRule;
  }

  async deleteRule(id: string): Promise<void> {
    const response = await this._fetch('rules/' + encodeURIComponent(id), { method: 'DELETE' });
    if (!response.ok) {
      throw errorFrom(response, await readJSON(response));
    }
  }

  /** The websocket's URL, with the token appended where JupyterLab's services append it. */
  streamUrl(rateHz: number): string {
    const s = this.settings;
    let url =
      URLExt.join(s.wsUrl, NAMESPACE, 'ws') + '?rate_hz=' + encodeURIComponent(String(rateHz));
    if (s.appendToken && s.token) {
      url += '&token=' + encodeURIComponent(s.token);
    }
    return url;
  }

  private async _json<T>(path: string): Promise<T> {
    const response = await this._fetch(path, {});
    const body = await readJSON(response);
    if (!response.ok) {
      throw errorFrom(response, body);
    }
    return body as T;
  }

  private async _fetch(path: string, init: RequestInit): Promise<Response> {
    const url = URLExt.join(this.settings.baseUrl, NAMESPACE, path);
    try {
      return await ServerConnection.makeRequest(url, init, this.settings);
    } catch (error) {
      throw new MonitorAPIError(`cannot reach ${url}: ${error}`, 0);
    }
  }
}

async function readJSON(response: Response): Promise<any> {
  const text = await response.text();
  if (!text) {
    return {};
  }
  try {
    return JSON.parse(text);
  } catch {
    return { message: text.slice(0, 300) };
  }
}

function errorFrom(response: Response, body: any): MonitorAPIError {
  const detail = body?.message || body?.reason || response.statusText;
  const hint =
    response.status === 404
      ? ' (is the jupyterlab_gpulab server extension enabled? see `jupyter server extension list`)'
      : '';
  return new MonitorAPIError(`${response.status} ${detail}${hint}`, response.status);
}
