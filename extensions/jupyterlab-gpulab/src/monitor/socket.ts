/**
 * A websocket that reconnects with exponential backoff (1 s doubling to 30 s, with jitter),
 * and starts again from 1 s once a connection has delivered a message.
 */
import { IDisposable } from '@lumino/disposable';

export type ConnectionState = 'connecting' | 'open' | 'waiting' | 'closed';

export interface IReconnectingSocketOptions {
  /** Called for each connection, so a changed rate or token is picked up. */
  url: () => string;
  onMessage: (data: unknown) => void;
  onState?: (state: ConnectionState, retryInSeconds?: number) => void;
  makeSocket?: (url: string) => WebSocket;
  initialDelaySeconds?: number;
  maxDelaySeconds?: number;
}

export class ReconnectingSocket implements IDisposable {
  constructor(private readonly _options: IReconnectingSocketOptions) {}

  get isDisposed(): boolean {
    return this._disposed;
  }

  get state(): ConnectionState {
    return this._state;
  }

  /** Open the connection (or re-open it now, e.g. after the rate changed). */
  connect(): void {
    if (this._disposed) {
      return;
    }
    this._clearTimer();
    this._closeSocket();
    this._setState('connecting');
    const url = this._options.url();
    let ws: WebSocket;
    try {
      ws = this._options.makeSocket ? this._options.makeSocket(url) : new WebSocket(url);
    } catch (error) {
      console.warn('gpulab: cannot open the GPU monitor websocket', error);
      this._scheduleRetry();
      return;
    }
    this._ws = ws;
    ws.onmessage = event => {
      if (this._ws !== ws) {
        return;
      }
      this._delay = this._initialDelay;
      if (this._state !== 'open') {
        this._setState('open');
      }
      let data: unknown;
      try {
        data = JSON.parse(String(event.data));
      } catch {
        console.warn('gpulab: ignoring a monitor message that is not JSON');
        return;
      }
      this._options.onMessage(data);
    };
    ws.onclose = () => {
      if (this._ws === ws) {
        this._ws = null;
        this._scheduleRetry();
      }
    };
    ws.onerror = () => {
      // onclose follows and schedules the retry
    };
  }

  dispose(): void {
    if (this._disposed) {
      return;
    }
    this._disposed = true;
    this._clearTimer();
    this._closeSocket();
    this._setState('closed');
  }

  private _scheduleRetry(): void {
    if (this._disposed) {
      return;
    }
    const delay = this._delay * (0.8 + 0.4 * Math.random());
    this._delay = Math.min(this._delay * 2, this._maxDelay);
    this._setState('waiting', delay);
    this._timer = window.setTimeout(() => this.connect(), delay * 1000);
  }

  private _closeSocket(): void {
    const ws = this._ws;
    this._ws = null;
    if (ws) {
      ws.onmessage = null;
      ws.onclose = null;
      ws.onerror = null;
      ws.close();
    }
  }

  private _clearTimer(): void {
    if (this._timer !== null) {
      window.clearTimeout(this._timer);
      this._timer = null;
    }
  }

  private _setState(state: ConnectionState, retryIn?: number): void {
    this._state = state;
    this._options.onState?.(state, retryIn);
  }

  private _ws: WebSocket | null = null;
  private _timer: number | null = null;
  private _disposed = false;
  private _state: ConnectionState = 'closed';
  private readonly _initialDelay = this._options.initialDelaySeconds ?? 1;
  private readonly _maxDelay = this._options.maxDelaySeconds ?? 30;
  private _delay = this._initialDelay;
}
