/** CSV export of the filtered table (RFC 4180 quoting), downloaded from a Blob. */

import { duration, placeLabel, shareLabel } from './format';
import type { Workload } from './types';

export const CSV_COLUMNS: [string, (w: Workload) => string | number | boolean | null][] = [
  ['id', w => w.id],
  ['owner', w => w.owner],
  ['kind', w => w.kind],
  ['profile', w => w.profile],
  ['gpu_model', w => w.gpu_model],
  ['share', w => shareLabel(w)],
  ['gpus', w => w.gpus],
  ['node', w => w.node],
  ['devices', w => placeLabel(w)],
  ['tier', w => w.tier],
  ['over_quota', w => w.over_quota],
  ['started_at', w => w.started_at],
  ['ui_idle', w => duration(w.ui_idle_seconds)],
  ['gpu_idle', w => duration(w.gpu_idle_seconds)],
  ['monitored', w => w.monitored],
  ['utilization_percent', w => w.utilization],
  ['memory_used_mib', w => w.memory_used_mib],
  ['culling', w => w.culling?.verdict ?? null],
  ['culling_reason', w => w.culling?.reason ?? null]
];

/** One field: quoted when it holds a comma, quote or line break (quotes doubled); text that a
 * spreadsheet would run as a formula (=, +, -, @ first) gets a leading apostrophe. */
export function csvField(value: string | number | boolean | null): string {
  if (value === null) {
    return '';
  }
  if (typeof value !== 'string') {
    return String(value);
  }
  let text = value;
  if (/^[=+\-@\t\r]/.test(text)) {
    text = "'" + text;
  }
  return /[",\r\n]/.test(text) ? '"' + text.replace(/"/g, '""') + '"' : text;
}

export function toCsv(workloads: Workload[]): string {
  const lines = [CSV_COLUMNS.map(([name]) => name).join(',')];
  for (const w of workloads) {
    lines.push(CSV_COLUMNS.map(([, read]) => csvField(read(w))).join(','));
  }
  return lines.join('\r\n') + '\r\n';
}

export function downloadCsv(workloads: Workload[], now: Date = new Date()): void {
  const blob = new Blob([toCsv(workloads)], { type: 'text/csv;charset=utf-8' });
  const url = URL.createObjectURL(blob);
  const link = document.createElement('a');
  link.href = url;
  link.download = `gpulab-workloads-${now.toISOString().replace(/[:.]/g, '-')}.csv`;
  document.body.appendChild(link);
  link.click();
  link.remove();
  // after the click has handed the Blob to the download
  setTimeout(() => URL.revokeObjectURL(url), 0);
}
