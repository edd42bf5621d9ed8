/** The status bar item: "GPU 73% · 12.1/20.0 GiB"; a click opens the panel. */
import { Widget } from '@lumino/widgets';
import { statusText, summarize } from './format';
import { MonitorModel } from './model';

export class GpuStatusItem extends Widget {
  constructor(
    private readonly _model: MonitorModel,
    onClick: () => void
  ) {
    super();
    this.addClass('gpulab-status');
    this.addClass('jp-StatusBar-TextItem');
    this.node.dataset.testid = 'gpulab-status';
    this.node.title = 'GPU monitor: your share (click to open)';
    this.node.addEventListener('click', onClick);
    _model.changed.connect(this._render, this);
    this._render();
  }

  private _render(): void {
    const info = this._model.info;
    const latest = this._model.latest;
    const summary = latest ? summarize(latest) : null;
    let text: string;
    if (summary) {
      text = statusText(summary);
    } else if (info?.source === 'none' || (info && !info.devices.length)) {
      text = 'GPU: none';
    } else {
      text = 'GPU …';
    }
    if (info?.simulated) {
      text += ' (simulated)';
    }
    this.node.textContent = text;
    this.node.classList.toggle('gpulab-mod-alert', this._model.activeAlerts.length > 0);
  }
}
