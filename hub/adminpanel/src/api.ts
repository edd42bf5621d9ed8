/** The admin REST API, called as JupyterHub's own pages call the hub: the session cookie plus the
 * page's XSRF token (window.jhdata.xsrf_token) as the `_xsrf` query parameter. */

import type { Action, ActionResult, Overview } from './types';

declare global {
  interface Window {
    jhdata?: { xsrf_token?: string; base_url?: string };
  }
}

export function withXsrf(url: string): string {
  const token = window.jhdata?.xsrf_token;
  if (!token) {
    return url;
  }
  return url + (url.includes('?') ? '&' : '?') + '_xsrf=' + encodeURIComponent(token);
}

async function readError(response: Response): Promise<string> {
  try {
    const body = await response.json();
    if (body && typeof body.message === 'string') {
      return `${response.status}: ${body.message}`;
    }
  } catch {
    // not JSON: the status says enough
  }
  return `${response.status} ${response.statusText}`;
}

/** GET `url` (JSON) with the session cookie and the page's XSRF token. */
export async function fetchJson<T>(url: string): Promise<T> {
  const response = await fetch(withXsrf(url), { credentials: 'same-origin' });
  if (!response.ok) {
    throw new Error(await readError(response));
  }
  return (await response.json()) as T;
}

export async function fetchOverview(apiUrl: string): Promise<Overview> {
  return fetchJson<Overview>(apiUrl + 'overview');
}

export async function postAction(
  apiUrl: string,
  action: Action,
  ids: string[]
): Promise<ActionResult[]> {
  const response = await fetch(withXsrf(apiUrl + 'actions'), {
    method: 'POST',
    credentials: 'same-origin',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ action, ids })
  });
  if (!response.ok) {
    throw new Error(await readError(response));
  }
  const body = (await response.json()) as { results: ActionResult[] };
  return body.results;
}
