/** Alerts: the panel's list of active and recent ones, and JupyterLab notifications on transitions. */
import { Notification } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import { IAlertEvent } from './api';
import { clock } from './format';
import { MonitorModel } from './model';

export class AlertsSection extends Widget {
  constructor(private readonly _model: MonitorModel) {
    super();
    this.addClass('gpulab-section');
    this.addClass('gpulab-alerts');
    this.node.dataset.testid = 'gpulab-alerts';
    const heading = document.createElement('h3');
    heading.textContent = 'Active alerts';
    this._active = document.createElement('ul');
    this._active.className = 'gpulab-alert-list';
    this._active.dataset.testid = 'gpulab-active-alerts';
    const recentHeading = document.createElement('h4');
    recentHeading.textContent = 'Recent';
    this._recent = document.createElement('ul');
    this._recent.className = 'gpulab-alert-list gpulab-alert-history';
    this._recent.dataset.testid = 'gpulab-recent-alerts';
    this.node.append(heading, this._active, recentHeading, this._recent);
    _model.changed.connect((_, what) => {
      if (what === 'alerts') {
        this._render();
      }
    }, this);
    this._render();
  }

  private _render(): void {
    const active = this._model.activeAlerts;
    this._active.replaceChildren(...active.map(e => alertItem(e, 'gpulab-alert')));
    if (!active.length) {
      this._active.append(emptyItem('No alert is firing.'));
    }
    const recent = this._model.recentAlerts;
    this._recent.replaceChildren(...recent.map(e => alertItem(e, 'gpulab-alert-event')));
    if (!recent.length) {
      this._recent.append(emptyItem('Nothing yet.'));
    }
  }

  private readonly _active: HTMLUListElement;
  private readonly _recent: HTMLUListElement;
}

function alertItem(event: IAlertEvent, testId: string): HTMLLIElement {
  const item = document.createElement('li');
  item.className = `gpulab-alert-item gpulab-severity-${event.severity} gpulab-alert-${event.state}`;
  item.dataset.testid = testId;
  item.dataset.rule = event.rule;
  item.dataset.state = event.state;
  item.dataset.severity = event.severity;
  const badge = document.createElement('span');
  badge.className = 'gpulab-badge';
  badge.textContent = event.state === 'firing' ? event.severity : 'resolved';
  const text = document.createElement('span');
  text.className = 'gpulab-alert-text';
  text.textContent = withRule(event);
  const when = document.createElement('span');
  when.className = 'gpulab-alert-time';
  when.textContent =
    event.state === 'firing' ? `since ${clock(event.since)}` : `resolved ${clock(event.t)}`;
  if (event.device) {
    when.title = event.device;
  }
  item.append(badge, text, when);
  return item;
}

/** "HIGH_LOAD: gpu_utilization > 80% FOR 3s", naming the rule once. */
function withRule(event: IAlertEvent): string {
  return event.message.startsWith(event.rule) ? event.message : `${event.rule}: ${event.message}`;
}

function emptyItem(text: string): HTMLLIElement {
  const item = document.createElement('li');
  item.className = 'gpulab-empty';
  item.textContent = text;
  return item;
}

/** A notification for a live transition: error for critical rules, warning otherwise. */
export function notifyAlert(event: IAlertEvent, openPanel: () => void): void {
  const message = `GPU alert ${withRule(event)}`;
  const critical = ['critical', 'error'].includes(event.severity);
  const options = {
    // a critical alert stays until dismissed; the others fade
    autoClose: event.state === 'firing' && critical ? (false as const) : 15000,
    actions: [{ label: 'Open GPU monitor', callback: openPanel }]
  };
  if (event.state === 'resolved') {
    Notification.info(`Resolved: ${message}`, options);
  } else if (critical) {
    Notification.error(message, options);
  } else if (event.severity === 'info') {
    Notification.info(message, options);
  } else {
    Notification.warning(message, options);
  }
}
