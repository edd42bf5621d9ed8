/**
 * The owner's runs, polled from the server extension: every 3 s while a run is active (and the tab
 * visible) or the panel is shown, else every 30 s (a run submitted from jupyter-scheduler's form shows up then). A run
 * seen active (or submitted while the page was open) that ends raises `ended` (the plugin turns it into a notification).
 */
import { ISignal, Signal } from '@lumino/signaling';
import { IRun, isActive, listRuns } from './api';

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

  /**
   * The state a run's log stream reports with each piece (the hub's, when it sent the piece):
   * shown at once rather than at the next poll, and the list is asked again for the rest.
   */
  follow(id: number, state: string): void {
    const run = this._runs.find(r => r.id === id);
    if (!run || run.state === state) {
      return;
    }
    this._runs = this._runs.map(r => (r.id === id ? { ...r, state } : r));
    this._changed.emit();
    void this.refresh();
  }

  async refresh(): Promise<void> {
    clearTimeout(this._timer);
    // only the latest request's answer is shown: an earlier one still on its way (a poll, or the
    // refresh of a submit) would bring back a state the run has left
    const request = ++this._request;
    try {
      const runs = await listRuns();
      if (request !== this._request) {
        return; // a later refresh answers for it, and sets the next poll
      }
      for (const run of runs) {
        const before = this._active.get(run.id);
        // ended since last seen active, or submitted while this page was open and already over
        const wasActive = before ?? run.submitted_at >= this._since;
        if (wasActive && !isActive(run)) {
          this._ended.emit(run);
        }
        this._active.set(run.id, isActive(run));
      }
      this._runs = runs;
      this._error = '';
    } catch (reason) {
      if (request !== this._request) {
        return;
      }
      this._error = String((reason as Error).message ?? reason);
    }
    this._changed.emit();
    // a hidden tab asks slowly: nobody reads it, and each request is traffic through the proxy
    const active = this._runs.some(isActive) && !document.hidden;
    this._timer = setTimeout(
      () => void this.refresh(),
      active || this.watching ? FAST_MS : SLOW_MS
    );
  }

  private readonly _since = Date.now() / 1000;
  private _runs: IRun[] = [];
  private _error = '';
  private _active = new Map<number, boolean>();
  private _timer: ReturnType<typeof setTimeout> | undefined;
  private _request = 0;
  private _changed = new Signal<this, void>(this);
  private _ended = new Signal<this, IRun>(this);
}
