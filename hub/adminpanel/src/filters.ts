/** The table's filters, applied in the browser (the overview holds every workload). */

import type { Workload } from './types';

export interface Filters {
  /** words that must each appear in the owner or the kind (or the id or profile) */
  text: string;
  /** only workloads whose GPU has been idle longer than this many minutes ('' = no filter) */
  gpuIdleMinutes: string;
  overQuota: boolean;
  preemptible: boolean;
}

export const NO_FILTERS: Filters = {
  text: '',
  gpuIdleMinutes: '',
  overQuota: false,
  preemptible: false
};

export function matches(w: Workload, f: Filters): boolean {
  const words = f.text.toLowerCase().split(/\s+/).filter(Boolean);
  const haystack = [w.owner, w.kind, w.id, w.profile ?? ''].join(' ').toLowerCase();
  if (!words.every(word => haystack.includes(word))) {
    return false;
  }
  if (f.overQuota && !w.over_quota) {
    return false;
  }
  if (f.preemptible && w.tier !== 'preemptible') {
    return false;
  }
  const minutes = Number(f.gpuIdleMinutes);
  if (f.gpuIdleMinutes.trim() !== '' && Number.isFinite(minutes)) {
    // unknown GPU-idle time (no live figures yet) is not "idle longer than N"
    if (w.gpu_idle_seconds === null || w.gpu_idle_seconds <= minutes * 60) {
      return false;
    }
  }
  return true;
}

export function applyFilters(workloads: Workload[], f: Filters): Workload[] {
  return workloads.filter(w => matches(w, f));
}
