/** GPU-hours and GPU-hour budgets from the hub (GET /hub/api/gpulab/usage and
 * /hub/api/gpulab/admin/budgets), and what the panel makes of them. */

import { fetchJson, withXsrf } from './api';

/** One row of GET /hub/api/gpulab/usage?by=user */
export interface UsageRow {
  bucket: string;
  user: string;
  allocated_gpu_hours: number;
  used_gpu_hours: number;
  idle_gpu_hours: number;
  /** job runs' and Dask workers' part of allocated: no GPU figures, neither used nor idle */
  unmonitored_gpu_hours: number;
}

export interface Usage {
  since: string;
  until: string;
  rows: UsageRow[];
}

export interface BurnDownPoint {
  t: string;
  remaining_gpu_hours: number;
}

export type BudgetState = 'ok' | 'warn' | 'exhausted';

export interface BudgetInfo {
  scope: 'user' | 'group';
  name: string;
  limit_gpu_hours: number;
  allocated_gpu_hours: number;
  remaining_gpu_hours: number;
  state: BudgetState;
  users: string[];
  burn_down: BurnDownPoint[];
}

export interface Budgets {
  generated_at: string;
  window: { since: string; until: string; days: number; warn_percent: number };
  budgets: BudgetInfo[];
}

/** The windows "Top consumers" offers, in seconds */
export const WINDOWS: Record<string, { label: string; seconds: number }> = {
  '24h': { label: 'last 24 h', seconds: 86_400 },
  '7d': { label: 'last 7 days', seconds: 7 * 86_400 },
  '30d': { label: 'last 30 days', seconds: 30 * 86_400 }
};

/** /hub/api/gpulab/usage, beside the admin API (/hub/api/gpulab/admin/) */
export function usageUrl(apiUrl: string, params: Record<string, string>): string {
  const url = new URL('../usage', new URL(apiUrl, window.location.href));
  for (const [name, value] of Object.entries(params)) {
    url.searchParams.set(name, value);
  }
  return url.pathname + url.search;
}

/** The window's start as the usage API takes it (whole seconds since the epoch) */
export function windowStart(windowKey: string, now: number = Date.now()): string {
  return String(Math.floor(now / 1000) - WINDOWS[windowKey].seconds);
}

export async function fetchUsageByUser(apiUrl: string, since: string): Promise<Usage> {
  return fetchJson<Usage>(usageUrl(apiUrl, { by: 'user', bucket: 'day', since }));
}

export async function fetchBudgets(apiUrl: string): Promise<Budgets> {
  return fetchJson<Budgets>(apiUrl + 'budgets');
}

/** The server's CSV of GPU-hours per day, user and profile over the window (a download link) */
export function usageCsvUrl(apiUrl: string, since: string): string {
  return withXsrf(usageUrl(apiUrl, { format: 'csv', by: 'user,profile', bucket: 'day', since }));
}

export interface Consumer {
  user: string;
  allocated: number;
  used: number;
  idle: number;
  unmonitored: number;
}

/** Users by allocated GPU-hours over the rows (summed over the buckets), largest first. */
export function consumers(rows: UsageRow[], top: number): Consumer[] {
  const byUser = new Map<string, Consumer>();
  for (const r of rows) {
    const c = byUser.get(r.user) ?? {
      user: r.user,
      allocated: 0,
      used: 0,
      idle: 0,
      unmonitored: 0
    };
    c.allocated += r.allocated_gpu_hours;
    c.used += r.used_gpu_hours;
    c.idle += r.idle_gpu_hours;
    c.unmonitored += r.unmonitored_gpu_hours;
    byUser.set(r.user, c);
  }
  return [...byUser.values()]
    .filter(c => c.allocated > 0)
    .sort((a, b) => b.allocated - a.allocated || a.user.localeCompare(b.user))
    .slice(0, top);
}

/** 12.345 -> '12.3', 0.04 -> '0.04', 0 -> '0' */
export function gpuHours(value: number): string {
  if (value === 0) {
    return '0';
  }
  return value < 0.1 ? value.toPrecision(1) : value.toFixed(1);
}

/** Budgets past their warning share or used up (the "over quota" filter) */
export function overQuota(budgets: BudgetInfo[]): BudgetInfo[] {
  return budgets.filter(b => b.state !== 'ok');
}
