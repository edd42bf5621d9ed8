/**
 * The owner's runs, polled from the server extension: every 3 s while a run is active (and the tab
 * visible) or the panel is shown, else every 30 s (a run submitted from jupyter-scheduler's form shows up then). A run
 * seen active (or submitted while the page was open) that ends raises `ended` (the plugin turns it into a notification).
 */
import { ISignal, Signal } from '@lumino/signaling';
import { ACTIVE_STATES, IRun, listRuns } from './api';

const FAST_MS = 3000;
const SLOW_MS = 30000;

export class JobsModel {
  get runs(): IRun[] {
    return this._runs;
  }
  get error(): string {
    return this._error;
  }
  get changed(): ISignal<this, void> {
    return this._changed;
  }
  get ended(): ISignal<this, IRun> {
    return this._ended;
  }

  /** Poll fast while the panel is visible (it says so). */
  watching = false;

  start(): void {
    void this.refresh();
  }

  async refresh(): Promise<void> {
    clearTimeout(this._timer);
    try {
      const runs = await listRuns();
      for (const run of runs) {
        const before = this._states.get(run.id);
        // ended since last seen active, or submitted while this page was open and already over
        const wasActive = before ? ACTIVE_STATES.has(before) : run.submitted_at >= this._since;
        if (wasActive && !ACTIVE_STATES.has(run.state)) {
          this._ended.emit(run);
        }
        this._states.set(run.id, run.state);
      }
      this._runs = runs;
      this._error = '';
    } catch (reason) {
      this._error = String((reason as Error).message ?? reason);
    }
    this._changed.emit();
    // a hidden tab asks slowly: nobody reads it, and each request is traffic through the proxy
    const active = this._runs.some(r => ACTIVE_STATES.has(r.state)) && !document.hidden;
    this._timer = setTimeout(
      () => void this.refresh(),
      active || this.watching ? FAST_MS : SLOW_MS
    );
  }

  private readonly _since = Date.now() / 1000;
  private _runs: IRun[] = [];
  private _error = '';
  private _states = new Map<number, string>();
  private _timer: ReturnType<typeof setTimeout> | undefined;
  private _changed = new Signal<this, void>(this);
  private _ended = new Signal<this, IRun>(this);
}
