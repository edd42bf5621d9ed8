/** One device of the share: its figures, utilisation and memory charts, and its processes. */
import { Panel, Widget } from '@lumino/widgets';
import { IDeviceInfo, IDeviceSample, ISample } from './api';
import { TimeChart } from './chart';
import { gib, pct } from './format';

export class DeviceView extends Panel {
  constructor(readonly device: IDeviceInfo) {
    super();
    this.addClass('gpulab-device');
    this.node.dataset.testid = 'gpulab-device';
    this.node.dataset.uuid = device.uuid;

    const header = new Widget();
    header.addClass('gpulab-device-header');
    const name = document.createElement('span');
    name.className = 'gpulab-device-name';
    name.textContent = `GPU ${device.index}: ${device.name}${device.mig ? ' (MIG)' : ''}`;
    const uuid = document.createElement('span');
    uuid.className = 'gpulab-device-uuid';
    uuid.textContent = device.uuid;
    this._figures = document.createElement('div');
    this._figures.className = 'gpulab-device-figures';
    this._figures.dataset.testid = 'gpulab-device-figures';
    header.node.append(name, uuid, this._figures);
    this.addWidget(header);

    this._util = new TimeChart({
      testId: 'gpulab-util-chart',
      title: 'Utilisation',
      series: [{ label: 'utilisation', stroke: '--jp-brand-color1', unit: '%', digits: 0 }],
      yRange: () => [0, 100]
    });
    this._memory = new TimeChart({
      testId: 'gpulab-memory-chart',
      title: device.whole ? 'Memory' : 'Memory (limit: your share)',
      series: [
        { label: 'used', stroke: '--jp-success-color1', unit: 'GiB', digits: 2 },
        { label: 'limit', stroke: '--jp-error-color1', dash: [6, 4], unit: 'GiB', digits: 1 }
      ],
      yRange: max => [0, Math.max(max * 1.1, 1)]
    });
    const charts = new Panel();
    charts.addClass('gpulab-device-charts');
    charts.addWidget(this._util);
    charts.addWidget(this._memory);
    this.addWidget(charts);

    const processes = new Widget();
    processes.addClass('gpulab-processes');
    processes.node.dataset.testid = 'gpulab-processes';
    this._processes = processes.node;
    this.addWidget(processes);
  }

  showSamples(samples: readonly ISample[]): void {
    const uuid = this.device.uuid;
    const x: number[] = [];
    const util: (number | null)[] = [];
    const used: (number | null)[] = [];
    const limit: (number | null)[] = [];
    let latest: IDeviceSample | null = null;
    for (const sample of samples) {
      const d = sample.devices[uuid];
      if (!d) {
        continue;
      }
      x.push(sample.t);
      util.push(d.utilization_pct);
      used.push(d.memory_used_mib / 1024);
      limit.push((d.memory_limit_mib || this.device.memory_limit_mib) / 1024);
      latest = d;
    }
    this._util.setData(x, [util]);
    this._memory.setData(x, [used, limit]);
    if (latest) {
      this._showFigures(latest);
      this._showProcesses(latest);
    }
  }

  private _showFigures(d: IDeviceSample): void {
    const parts = [
      `utilisation ${pct(d.utilization_pct)}`,
      `memory ${gib(d.memory_used_mib)}/${gib(d.memory_limit_mib || this.device.memory_limit_mib)} GiB`
    ];
    if (typeof d.temperature_c === 'number') {
      parts.push(`${Math.round(d.temperature_c)} °C`);
    }
    if (typeof d.power_w === 'number') {
      parts.push(`${Math.round(d.power_w)} W`);
    }
    this._figures.textContent = parts.join(' · ');
  }

  private _showProcesses(d: IDeviceSample): void {
    const table = document.createElement('table');
    table.className = 'gpulab-process-table';
    const head = table.createTHead().insertRow();
    for (const label of ['PID', 'Process', 'Memory']) {
      const th = document.createElement('th');
      th.textContent = label;
      head.append(th);
    }
    const body = table.createTBody();
    const rows = [...d.processes].sort(
      (a, b) => Number(b.own) - Number(a.own) || b.memory_mib - a.memory_mib
    );
    for (const p of rows) {
      const row = body.insertRow();
      row.className = p.own ? 'gpulab-process gpulab-own' : 'gpulab-process';
      row.dataset.testid = 'gpulab-process';
      row.dataset.own = String(p.own);
      row.insertCell().textContent = String(p.pid);
      row.insertCell().textContent = p.own ? `${p.name} (yours)` : p.name || '(another server)';
      row.insertCell().textContent = `${gib(p.memory_mib)} GiB`;
    }
    if (!rows.length) {
      const cell = body.insertRow().insertCell();
      cell.colSpan = 3;
      cell.className = 'gpulab-empty';
      cell.textContent = 'No processes on this device.';
    }
    this._processes.replaceChildren(table);
  }

  private readonly _util: TimeChart;
  private readonly _memory: TimeChart;
  private readonly _figures: HTMLDivElement;
  private readonly _processes: HTMLElement;
}
