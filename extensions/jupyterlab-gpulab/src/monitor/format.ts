/** How figures read in the panel and the status bar. */
import { IDeviceSample, IShare, ISample } from './api';

export function gib(mib: number): string {
  return (mib / 1024).toFixed(1);
}

export function pct(value: number | null | undefined): string {
  return value === null || value === undefined ? '–' : `${Math.round(value)}%`;
}

/** 0.5 → "1/2 GPU", 0.3 → "30% of a GPU", null → "whole GPU". */
export function fraction(share: IShare): string {
  const f = share.fraction;
  if (f === null || f === undefined) {
    return 'whole GPU';
  }
  for (let d = 2; d <= 16; d++) {
    const n = Math.round(f * d);
    if (n > 0 && Math.abs(n / d - f) < 1e-6) {
      return `${n}/${d} GPU`;
    }
  }
  return `${Math.round(f * 100)}% of a GPU`;
}

export interface ISummary {
  utilizationPct: number | null;
  usedMib: number;
  limitMib: number;
}

/** All devices of a sample together: mean utilisation, summed memory. */
export function summarize(sample: ISample): ISummary | null {
  const devices: IDeviceSample[] = Object.values(sample.devices);
  if (!devices.length) {
    return null;
  }
  const utils = devices
    .map(d => d.utilization_pct)
    .filter((u): u is number => typeof u === 'number');
  return {
    utilizationPct: utils.length ? utils.reduce((a, b) => a + b, 0) / utils.length : null,
    usedMib: devices.reduce((a, d) => a + d.memory_used_mib, 0),
    limitMib: devices.reduce((a, d) => a + d.memory_limit_mib, 0)
  };
}

/** "GPU 73% · 12.1/20.0 GiB" */
export function statusText(summary: ISummary): string {
  return `GPU ${pct(summary.utilizationPct)} · ${gib(summary.usedMib)}/${gib(summary.limitMib)} GiB`;
}

export function clock(t: number): string {
  return new Date(t * 1000).toLocaleTimeString();
}
