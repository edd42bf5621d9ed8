/**
 * The "GPU jobs" panel: the owner's runs with state, queue position and reason, attempts; the
 * selected run's live log, outputs (opened in the lab), cancel, rerun and its TensorBoard.
 *
 * Why a panel of gpulab's beside jupyter-scheduler's job list: the scheduler's models have no
 * place for a queue position, attempts or a live log, and its UI opens no TensorBoard; its list
 * still shows the same runs (the gpulab backend), with the queue position in the status message.
 */
import { Notification } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import { gpuIcon } from '../monitor/icon';
import { IRun, cancelRun, getRun, isActive, logStreamUrl, rerun } from './api';
import { JobsModel } from './model';

export const JOBS_PANEL_ID = 'gpulab-gpu-jobs';

export class GpuJobsPanel extends Widget {
  constructor(
    private readonly _model: JobsModel,
    private readonly _openPath: (path: string) => void
  ) {
    super();
    this.id = JOBS_PANEL_ID;
    this.addClass('gpulab-monitor');
    this.addClass('gpulab-jobs');
    this.node.dataset.testid = 'gpulab-jobs';
    this.title.label = 'GPU jobs';
    this.title.caption = 'Your GPU job runs: queue, state, logs, outputs, TensorBoard';
    this.title.icon = gpuIcon;
    this.title.closable = true;

    const heading = document.createElement('h3');
    heading.textContent = 'GPU job runs';
    this._error = document.createElement('div');
    this._error.className = 'gpulab-error';
    this._list = document.createElement('ul');
    this._list.className = 'gpulab-job-list';
    this._list.dataset.testid = 'gpulab-job-list';
    this._detail = document.createElement('div');
    this._detail.className = 'gpulab-job-detail';
    this._detail.dataset.testid = 'gpulab-job-detail';
    this.node.append(heading, this._error, this._list, this._detail);
    _model.changed.connect(this._render, this);
    this._render();
  }

  protected onAfterShow(): void {
    this._model.watching = true;
    void this._model.refresh();
  }

  protected onAfterHide(): void {
    this._model.watching = false;
  }

  dispose(): void {
    this._closeLog();
    this._model.watching = false;
    super.dispose();
  }

  /** Show run `id` (its log, attempts, outputs). */
  select(id: number): void {
    this._selected = id;
    this._render();
  }

  private _render(): void {
    this._error.textContent = this._model.error;
    const runs = this._model.runs;
    this._list.replaceChildren(...runs.map(run => this._item(run)));
    if (!runs.length) {
      const empty = document.createElement('li');
      empty.className = 'gpulab-empty';
      empty.textContent =
        'No runs yet. Submit a notebook with "Create a notebook job" (jupyter-scheduler) and ' +
        'pick the "GPU job (gpulab)" environment and a GPU profile.';
      this._list.append(empty);
    }
    if (this._selected === null && runs.length) {
      this._selected = runs[0].id;
    }
    const run = runs.find(r => r.id === this._selected);
    if (run) {
      // the list has no outputs: the run's own record, again whenever it changed
      const shown = this._detailRun;
      if (shown && shown.id === run.id && shown.updated_at === run.updated_at) {
        this._renderDetail(shown);
      } else {
        this._renderDetail(run);
        void getRun(run.id).then(full => {
          if (full.id === this._selected) {
            this._detailRun = full;
            this._renderDetail(full);
          }
        });
      }
    } else {
      this._detail.replaceChildren();
      this._closeLog();
    }
  }

  private _item(run: IRun): HTMLLIElement {
    const item = document.createElement('li');
    item.className = `gpulab-job-item gpulab-job-${run.state}`;
    if (run.id === this._selected) {
      item.classList.add('gpulab-selected');
    }
    item.dataset.testid = 'gpulab-job-run';
    item.dataset.run = String(run.id);
    item.dataset.state = run.state;
    const badge = document.createElement('span');
    badge.className = 'gpulab-badge';
    badge.textContent = run.state.replace('_', ' ');
    const name = document.createElement('span');
    name.className = 'gpulab-job-name';
    name.textContent = `${run.spec.name} #${run.id}`;
    const profile = document.createElement('span');
    profile.className = 'gpulab-job-profile';
    profile.textContent = run.spec.profile;
    const status = document.createElement('span');
    status.className = 'gpulab-job-status';
    status.dataset.testid = 'gpulab-job-status';
    status.textContent = run.status_message;
    item.append(badge, name, profile, status);
    item.addEventListener('click', () => this.select(run.id));
    return item;
  }

  private _renderDetail(run: IRun): void {
    if (this._detailFor !== run.id) {
      this._detailFor = run.id;
      this._log.textContent = '';
      this._closeLog();
      this._openLog(run.id);
    }
    const title = document.createElement('h4');
    title.textContent = `${run.spec.name} #${run.id}: ${run.spec.path} on ${run.spec.profile}`;

    const actions = document.createElement('div');
    actions.className = 'gpulab-job-actions';
    const active = isActive(run);
    actions.append(
      button('Cancel', 'gpulab-job-cancel', !active, async () => {
        await cancelRun(run.id);
        await this._model.refresh();
      }),
      button('Rerun', 'gpulab-job-rerun', false, async () => {
        const again = await rerun(run.id);
        this._selected = again.id;
        await this._model.refresh();
      }),
      button('TensorBoard', 'gpulab-job-tensorboard', !run.tensorboard_url, async () => {
        window.open(run.tensorboard_url, '_blank');
      })
    );

    const attempts = document.createElement('ul');
    attempts.className = 'gpulab-job-attempts';
    attempts.dataset.testid = 'gpulab-job-attempts';
    for (const a of run.attempts) {
      const li = document.createElement('li');
      const exit = a.exit_code === null ? '' : `, exit ${a.exit_code}`;
      li.textContent = `attempt ${a.number}: ${a.state} on ${a.gpus}${exit}${a.reason ? ` (${a.reason})` : ''}`;
      attempts.append(li);
    }

    const outputs = document.createElement('ul');
    outputs.className = 'gpulab-job-outputs';
    outputs.dataset.testid = 'gpulab-job-outputs';
    for (const path of run.output_paths) {
      const li = document.createElement('li');
      const link = document.createElement('a');
      link.href = '#';
      link.textContent = path;
      link.addEventListener('click', event => {
        event.preventDefault();
        this._openPath(path);
      });
      li.append(link);
      outputs.append(li);
    }
    if (!run.output_paths.length) {
      outputs.append(
        Object.assign(document.createElement('li'), { textContent: 'No outputs yet.' })
      );
    }
    const logTitle = document.createElement('h4');
    logTitle.textContent = 'Log (live)';
    const outputsTitle = document.createElement('h4');
    outputsTitle.textContent = 'Outputs';
    this._detail.replaceChildren(
      title,
      actions,
      attempts,
      logTitle,
      this._log,
      outputsTitle,
      outputs
    );
  }

  private _openLog(id: number): void {
    const source = new EventSource(logStreamUrl(id));
    source.onmessage = event => {
      const piece = JSON.parse(event.data) as { attempt: number; data: string; state?: string };
      this._log.textContent += piece.data;
      this._log.scrollTop = this._log.scrollHeight;
      if (piece.state) {
        // the badge shows the state the log is in, not the list's last poll
        this._model.follow(id, piece.state);
      }
    };
    source.addEventListener('end', () => source.close());
    this._source = source;
  }

  private _closeLog(): void {
    this._source?.close();
    this._source = null;
  }

  private readonly _error: HTMLDivElement;
  private readonly _list: HTMLUListElement;
  private readonly _detail: HTMLDivElement;
  private readonly _log: HTMLPreElement = Object.assign(document.createElement('pre'), {
    className: 'gpulab-job-log'
  });
  private _selected: number | null = null;
  private _detailRun: IRun | null = null;
  private _detailFor: number | null = null;
  private _source: EventSource | null = null;
}

function button(
  label: string,
  testId: string,
  disabled: boolean,
  onClick: () => Promise<void>
): HTMLButtonElement {
  const b = document.createElement('button');
  b.className = 'jp-mod-styled gpulab-button';
  b.textContent = label;
  b.dataset.testid = testId;
  b.disabled = disabled;
  b.addEventListener('click', () => {
    onClick().catch(reason =>
      Notification.error(`GPU job: ${String((reason as Error).message ?? reason)}`, {
        autoClose: 10000
      })
    );
  });
  return b;
}
