import { useCallback, useEffect, useMemo, useState } from 'react';

import { fetchOverview, postAction } from './api';
import { downloadCsv } from './csv';
import { applyFilters, NO_FILTERS, type Filters } from './filters';
import type { Action, ActionResult, Overview } from './types';
import { FilterBar } from './components/FilterBar';
import { GpuMap } from './components/GpuMap';
import { BudgetsSection } from './components/Budgets';
import { TopConsumers } from './components/TopConsumers';
import { WorkloadTable } from './components/WorkloadTable';

/** How often the panel reads the overview again */
export const REFRESH_MS = 10_000;

const CONFIRM: Record<Action, string> = {
  stop: 'Stop',
  preempt: 'Preempt'
};

export function App({ apiUrl }: { apiUrl: string }) {
  const [overview, setOverview] = useState<Overview | null>(null);
  const [loadError, setLoadError] = useState<string | null>(null);
  const [filters, setFilters] = useState<Filters>(NO_FILTERS);
  const [selected, setSelected] = useState<Set<string>>(new Set());
  const [results, setResults] = useState<ActionResult[] | null>(null);
  const [actionError, setActionError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);

  const refresh = useCallback(async () => {
    try {
      setOverview(await fetchOverview(apiUrl));
      setLoadError(null);
    } catch (e) {
      setLoadError(`Could not read the overview: ${(e as Error).message}`);
    }
  }, [apiUrl]);

  useEffect(() => {
    void refresh();
    const timer = window.setInterval(() => void refresh(), REFRESH_MS);
    return () => window.clearInterval(timer);
  }, [refresh]);

  const shown = useMemo(
    () => applyFilters(overview?.workloads ?? [], filters),
    [overview, filters]
  );
  // what is selected and still shown: a refresh or a filter never acts on hidden rows
  const chosen = shown.filter(w => selected.has(w.id)).map(w => w.id);

  const toggle = (id: string, on: boolean) => {
    const next = new Set(selected);
    if (on) {
      next.add(id);
    } else {
      next.delete(id);
    }
    setSelected(next);
  };
  const toggleAll = (on: boolean) => setSelected(on ? new Set(shown.map(w => w.id)) : new Set());

  const act = async (action: Action) => {
    if (chosen.length === 0) {
      return;
    }
    const what = `${CONFIRM[action]} ${chosen.length} workload${chosen.length === 1 ? '' : 's'}?\n${chosen.join('\n')}`;
    if (!window.confirm(what)) {
      return;
    }
    setBusy(true);
    setActionError(null);
    try {
      setResults(await postAction(apiUrl, action, chosen));
      setSelected(new Set());
    } catch (e) {
      setActionError(`${CONFIRM[action]} failed: ${(e as Error).message}`);
    } finally {
      setBusy(false);
      await refresh();
    }
  };

  return (
    <div>
      {loadError && (
        <div className="alert alert-danger" role="alert">
          {loadError}
        </div>
      )}
      {overview && (
        <p className="small text-muted" aria-label="Inventory">
          {overview.inventory} - updated {new Date(overview.generated_at).toLocaleTimeString()}
          {' - '}
          {overview.workloads.length} workloads
        </p>
      )}
      <FilterBar filters={filters} onChange={setFilters} />
      <div className="mb-2 d-flex gap-2 align-items-center" role="toolbar" aria-label="Actions">
        <button
          type="button"
          className="btn btn-sm btn-danger"
          aria-label="Stop selected workloads"
          disabled={busy || chosen.length === 0}
          onClick={() => void act('stop')}
        >
          Stop
        </button>
        <button
          type="button"
          className="btn btn-sm btn-warning"
          aria-label="Preempt selected workloads"
          disabled={busy || chosen.length === 0}
          onClick={() => void act('preempt')}
        >
          Preempt
        </button>
        <button
          type="button"
          className="btn btn-sm btn-outline-secondary"
          aria-label="Export CSV"
          onClick={() => downloadCsv(shown)}
        >
          Export CSV
        </button>
        <span className="small text-muted" aria-live="polite">
          {chosen.length} selected, {shown.length} shown
          {busy && ' - working...'}
        </span>
      </div>
      {actionError && (
        <div className="alert alert-danger" role="alert">
          {actionError}
        </div>
      )}
      {results && (
        <ul className="list-unstyled small" role="status" aria-label="Action results">
          {results.map(r => (
            <li key={r.id} className={r.ok ? 'text-success' : 'text-danger'} data-ok={r.ok}>
              {r.id}: {r.message}
            </li>
          ))}
        </ul>
      )}
      <WorkloadTable
        workloads={shown}
        selected={selected}
        onToggle={toggle}
        onToggleAll={toggleAll}
      />
      {overview && <GpuMap nodes={overview.nodes} />}
      <TopConsumers apiUrl={apiUrl} />
      <BudgetsSection apiUrl={apiUrl} />
    </div>
  );
}
