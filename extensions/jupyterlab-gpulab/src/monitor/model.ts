/**
 * The GPU monitor's state, shared by the panel and the status bar item: the share and its
 * devices, a window of samples (backfilled over REST, then live over the websocket), the rules
 * and the alerts.
 */
import { ISignal, Signal } from '@lumino/signaling';
import {
  IAlertEvent,
  IDevicesReply,
  IRule,
  ISample,
  MonitorAPI,
  MonitorAPIError,
  StreamMessage
} from './api';
import { ConnectionState, ReconnectingSocket } from './socket';

export interface IMonitorOptions {
  refreshRateHz: number;
  historySeconds: number;
}

export const DEFAULT_OPTIONS: IMonitorOptions = { refreshRateHz: 1, historySeconds: 300 };

/** How many past alert events the panel keeps. */
const RECENT_ALERTS = 50;

export class MonitorModel {
  constructor(
    readonly api: MonitorAPI = new MonitorAPI(),
    options: Partial<IMonitorOptions> = {}
  ) {
    this._options = { ...DEFAULT_OPTIONS, ...options };
    this._socket = new ReconnectingSocket({
      url: () => this.api.streamUrl(this.rateHz),
      onMessage: data => this._onMessage(data as StreamMessage),
      onState: (state, retryIn) => {
        this._connection = state;
        this._retryInSeconds = retryIn ?? null;
        if (state === 'open') {
          // after a gap, fetch what the socket missed
          void this._backfill();
        }
        this._changed.emit('connection');
      }
    });
  }

  /** Emits what changed: 'devices', 'sample', 'alerts', 'rules', 'connection', 'error'. */
  get changed(): ISignal<this, string> {
    return this._changed;
  }

  /** Emits each live alert transition (not those read at start). */
  get alertReceived(): ISignal<this, IAlertEvent> {
    return this._alertReceived;
  }

  get info(): IDevicesReply | null {
    return this._info;
  }

  get samples(): readonly ISample[] {
    return this._samples;
  }

  get latest(): ISample | null {
    return this._samples.length ? this._samples[this._samples.length - 1] : null;
  }

  get rules(): readonly IRule[] {
    return this._rules;
  }

  /** The server's word on rules it could not load, or on rules being unavailable. */
  get rulesError(): string {
    return this._rulesError;
  }

  get activeAlerts(): readonly IAlertEvent[] {
    return [...this._active.values()];
  }

  get recentAlerts(): readonly IAlertEvent[] {
    return this._recent;
  }

  get connection(): ConnectionState {
    return this._connection;
  }

  get retryInSeconds(): number | null {
    return this._retryInSeconds;
  }

  /** Why the monitor has no data, when the server extension could not be reached. */
  get error(): string | null {
    return this._error;
  }

  /** The rate asked of the server: the setting, capped at the server's maximum. */
  get rateHz(): number {
    const max = this._info?.max_rate_hz;
    const wanted = this._options.refreshRateHz;
    return max && max > 0 ? Math.min(wanted, max) : wanted;
  }

  /** The rate the server streams at on the current connection (its hello says). */
  get grantedRateHz(): number | null {
    return this._connection === 'open' ? this._grantedRateHz : null;
  }

  get historySeconds(): number {
    return this._options.historySeconds;
  }

  /** Read the share, backfill, then stream. */
  async start(): Promise<void> {
    if (this._started) {
      return;
    }
    this._started = true;
    try {
      this._setInfo(await this.api.devices());
    } catch (error) {
      this._fail(error);
      if (error instanceof MonitorAPIError && error.status === 404) {
        return; // no server extension: nothing to stream from
      }
    }
    await Promise.all([this._backfill(), this.refreshRules(), this.refreshAlerts()]);
    this._socket.connect();
  }

  setOptions(options: Partial<IMonitorOptions>): void {
    const before = this.rateHz;
    this._options = { ...this._options, ...options };
    this._trim();
    if (this._started && this.rateHz !== before && this._connection !== 'closed') {
      this._socket.connect();
    }
  }

  async refreshRules(): Promise<void> {
    try {
      const reply = await this.api.rules();
      this._rules = reply.rules;
      this._rulesError = reply.error ?? '';
      this._changed.emit('rules');
    } catch (error) {
      this._fail(error);
    }
  }

  async refreshAlerts(): Promise<void> {
    try {
      const reply = await this.api.alerts();
      this._active.clear();
      for (const event of reply.active) {
        this._active.set(alertKey(event), event);
      }
      this._recent = reply.recent.slice(-RECENT_ALERTS).reverse();
      this._changed.emit('alerts');
    } catch (error) {
      this._fail(error);
    }
  }

  /** Add a rule; rejects with the server's `RuleError` for a rule it cannot parse. */
  async addRule(text: string): Promise<IRule> {
    const rule = await this.api.addRule(text);
    await this.refreshRules();
    return rule;
  }

  async deleteRule(id: string): Promise<void> {
    await this.api.deleteRule(id);
    await this.refreshRules();
  }

  dispose(): void {
    this._socket.dispose();
    Signal.clearData(this);
  }

  private _onMessage(message: StreamMessage): void {
    switch (message.type) {
      case 'hello': {
        const { type: _type, rate_hz: rate, ...info } = message;
        this._grantedRateHz = rate;
        this._setInfo(info);
        break;
      }
      case 'sample':
        this._addSamples([message.sample]);
        break;
      case 'alert':
        this._addAlert(message.event);
        break;
    }
  }

  private _setInfo(info: IDevicesReply): void {
    this._info = info;
    this._error = null;
    this._changed.emit('devices');
  }

  private async _backfill(): Promise<void> {
    const last = this.latest?.t;
    const since = last ?? Date.now() / 1000 - this._options.historySeconds;
    try {
      this._addSamples(await this.api.samples(since));
    } catch (error) {
      this._fail(error);
    }
  }

  /** Merge samples in time order; backfill and stream may overlap or arrive out of order. */
  private _addSamples(samples: ISample[]): void {
    let added = false;
    for (const sample of samples) {
      const list = this._samples;
      const last = list.length ? list[list.length - 1].t : -Infinity;
      if (sample.t > last) {
        list.push(sample);
        added = true;
        continue;
      }
      // a sample from a gap the backfill closes: find its place, skip it if we have it
      let lo = 0;
      let hi = list.length;
      while (lo < hi) {
        const mid = (lo + hi) >> 1;
        if (list[mid].t < sample.t) {
          lo = mid + 1;
        } else {
          hi = mid;
        }
      }
      if (lo < list.length && list[lo].t === sample.t) {
        continue;
      }
      list.splice(lo, 0, sample);
      added = true;
    }
    if (added) {
      this._trim();
      this._changed.emit('sample');
    }
  }

  private _trim(): void {
    const last = this.latest;
    if (!last) {
      return;
    }
    const cutoff = last.t - this._options.historySeconds;
    let drop = 0;
    while (drop < this._samples.length && this._samples[drop].t < cutoff) {
      drop++;
    }
    if (drop) {
      this._samples.splice(0, drop);
    }
  }

  private _addAlert(event: IAlertEvent): void {
    const key = alertKey(event);
    if (event.state === 'firing') {
      this._active.set(key, event);
    } else {
      this._active.delete(key);
    }
    this._recent.unshift(event);
    this._recent.length = Math.min(this._recent.length, RECENT_ALERTS);
    this._changed.emit('alerts');
    this._alertReceived.emit(event);
  }

  private _fail(error: unknown): void {
    this._error = error instanceof Error ? error.message : String(error);
    console.warn('gpulab monitor:', this._error);
    this._changed.emit('error');
  }

  private _options: IMonitorOptions;
  private _socket: ReconnectingSocket;
  private _started = false;
  private _info: IDevicesReply | null = null;
  private _samples: ISample[] = [];
  private _rules: IRule[] = [];
  private _rulesError = '';
  private _active = new Map<string, IAlertEvent>();
  private _recent: IAlertEvent[] = [];
  private _connection: ConnectionState = 'closed';
  private _retryInSeconds: number | null = null;
  private _grantedRateHz: number | null = null;
  private _error: string | null = null;
  private _changed = new Signal<this, string>(this);
  private _alertReceived = new Signal<this, IAlertEvent>(this);
}

function alertKey(event: IAlertEvent): string {
  return `${event.rule}\u0000${event.device}`;
}
