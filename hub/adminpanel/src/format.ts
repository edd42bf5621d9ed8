/** How figures read in the table, the CSV and the map. */

import type { Workload } from './types';

/** 0.25 -> '1/4 GPU', 1 -> '1 GPU', 2 -> '2 GPUs', 0.3 -> '0.3 GPU', 0 -> 'no GPU' */
export function gpuAmount(gpus: number): string {
  if (gpus === 0) {
    return 'no GPU';
  }
  if (Number.isInteger(gpus)) {
    return `${gpus} GPU${gpus === 1 ? '' : 's'}`;
  }
  for (const denominator of [2, 4, 8]) {
    const numerator = gpus * denominator;
    if (Math.abs(numerator - Math.round(numerator)) < 1e-9 && gpus < 1) {
      return `${Math.round(numerator)}/${denominator} GPU`;
    }
  }
  return `${Number(gpus.toFixed(3))} GPU`;
}

/** The share as the table shows it: the MIG slice where there is one, else the fraction. */
export function shareLabel(w: Workload): string {
  return w.mig_profile ? `MIG ${w.mig_profile}` : gpuAmount(w.gpus);
}

/** 'node-1: GPU 0, 3' (the devices' indices on the node) */
export function placeLabel(w: Workload): string {
  if (w.devices.length === 0) {
    return w.node;
  }
  const indices = w.devices.map(d => (d.index === null ? d.uuid : String(d.index)));
  return `${w.node}: GPU ${indices.join(', ')}`;
}

/** 3725 -> '1 h 2 min', 59 -> '0 min', null -> '' (unknown) */
export function duration(seconds: number | null): string {
  if (seconds === null) {
    return '';
  }
  const minutes = Math.floor(seconds / 60);
  if (minutes < 60) {
    return `${minutes} min`;
  }
  const hours = Math.floor(minutes / 60);
  if (hours < 48) {
    return `${hours} h ${minutes % 60} min`;
  }
  return `${Math.floor(hours / 24)} d ${hours % 24} h`;
}

export function percent(value: number | null): string {
  return value === null ? '' : `${Math.round(value)} %`;
}

export function mebibytes(value: number | null): string {
  return value === null ? '' : `${Math.round(value)} MiB`;
}

/** The culler's latest decision in a word or two: 'keep', 'warned (dry run)', 'culling' */
export function cullingLabel(w: Workload): string {
  const c = w.culling;
  if (!c) {
    return '';
  }
  const word = { keep: 'keep', exempt: 'exempt', warn: 'warned', wait: 'warned', cull: 'culling' }[
    c.verdict
  ];
  return c.dry_run ? `${word} (dry run)` : word;
}
