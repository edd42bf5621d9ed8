/** The "GPU monitor" panel: the share, a view per device, the rules and the alerts. */
import { Panel, Widget } from '@lumino/widgets';
import { fetchBudget, showBudget } from '../budget/api';
import { AlertsSection } from './alerts';
import { DeviceView } from './device';
import { fraction } from './format';
import { MonitorModel } from './model';
import { RulesSection } from './rules';
import { gpuIcon } from './icon';

export const PANEL_ID = 'gpulab-gpu-monitor';

export class GpuMonitorPanel extends Panel {
  constructor(private readonly _model: MonitorModel) {
    super();
    this.id = PANEL_ID;
    this.addClass('gpulab-monitor');
    this.node.dataset.testid = 'gpulab-monitor';
    this.title.label = 'GPU monitor';
    this.title.caption = 'Your GPU share: utilisation, memory, processes, alerts';
    this.title.icon = gpuIcon;
    this.title.closable = true;

    this._share = new Widget();
    this._share.addClass('gpulab-share');
    this._share.node.dataset.testid = 'gpulab-share';
    this.addWidget(this._share);

    this._budget = new Widget();
    this._budget.node.dataset.testid = 'gpulab-budget';
    showBudget(this._budget.node, null);
    this.addWidget(this._budget);
    void this._refreshBudget();

    this._devices = new Panel();
    this._devices.addClass('gpulab-devices');
    this.addWidget(this._devices);

    this.addWidget(new AlertsSection(_model));
    this.addWidget(new RulesSection(_model));

    _model.changed.connect(this._onChanged, this);
    this._renderShare();
    this._renderDevices();
  }

  private _onChanged(_: MonitorModel, what: string): void {
    if (what === 'devices' || what === 'error' || what === 'connection') {
      this._renderShare();
    }
    if (what === 'devices') {
      this._renderDevices();
    }
    if (what === 'sample' && this.isVisible) {
      this._showSamples();
    }
  }

  protected onAfterShow(): void {
    this._showSamples();
    void this._refreshBudget();
  }

  /** The owner's GPU-hours left (hidden when no budget binds her, or it cannot be read). */
  private async _refreshBudget(): Promise<void> {
    const reply = await fetchBudget().catch(() => null);
    showBudget(this._budget.node, reply);
  }

  private _renderShare(): void {
    const node = this._share.node;
    node.replaceChildren();
    const info = this._model.info;
    const heading = document.createElement('div');
    heading.className = 'gpulab-share-heading';
    const title = document.createElement('span');
    title.className = 'gpulab-share-title';
    title.textContent = 'Your GPU share';
    heading.append(title);
    if (info?.simulated) {
      heading.append(
        badge('SIMULATED devices', 'gpulab-simulated-badge', 'gpulab-badge gpulab-badge-simulated')
      );
    }
    heading.append(this._connectionBadge());
    node.append(heading);

    if (info) {
      const facts = document.createElement('dl');
      facts.className = 'gpulab-share-facts';
      const fact = (term: string, value: string, testId: string) => {
        const dt = document.createElement('dt');
        dt.textContent = term;
        const dd = document.createElement('dd');
        dd.textContent = value;
        dd.dataset.testid = testId;
        facts.append(dt, dd);
      };
      fact('Profile', info.share.profile || '(none)', 'gpulab-share-profile');
      fact('Share', fraction(info.share), 'gpulab-share-fraction');
      fact('Enforcement', info.share.enforcement || '(none)', 'gpulab-share-enforcement');
      fact('Source', info.source, 'gpulab-share-source');
      node.append(facts);
    }
    const message = info?.source === 'none' || !info?.devices.length ? info?.message : '';
    if (message) {
      node.append(badge(message, 'gpulab-source-message', 'gpulab-message'));
    }
    if (this._model.error) {
      node.append(
        badge(this._model.error, 'gpulab-monitor-error', 'gpulab-message gpulab-message-error')
      );
    }
  }

  private _connectionBadge(): HTMLElement {
    const state = this._model.connection;
    const retry = this._model.retryInSeconds;
    const text =
      state === 'open'
        ? `live · ${this._model.grantedRateHz ?? this._model.rateHz} Hz`
        : state === 'waiting' && retry !== null
          ? `reconnecting in ${Math.ceil(retry)} s`
          : state;
    const el = badge(text, 'gpulab-connection', `gpulab-badge gpulab-connection-${state}`);
    el.dataset.state = state;
    return el;
  }

  private _renderDevices(): void {
    const devices = this._model.info?.devices ?? [];
    const same =
      devices.length === this._views.length &&
      devices.every((d, i) => this._views[i].device.uuid === d.uuid);
    if (same) {
      return;
    }
    for (const view of this._views) {
      view.dispose();
    }
    this._views = devices.map(d => new DeviceView(d));
    for (const view of this._views) {
      this._devices.addWidget(view);
    }
    this._showSamples();
  }

  private _showSamples(): void {
    const samples = this._model.samples;
    for (const view of this._views) {
      view.showSamples(samples);
    }
  }

  private readonly _share: Widget;
  private readonly _budget: Widget;
  private readonly _devices: Panel;
  private _views: DeviceView[] = [];
}

function badge(text: string, testId: string, className: string): HTMLElement {
  const el = document.createElement('span');
  el.className = className;
  el.dataset.testid = testId;
  el.textContent = text;
  return el;
}
