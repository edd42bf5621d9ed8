import { cullingLabel, duration, mebibytes, percent, placeLabel, shareLabel } from '../format';
import type { Workload } from '../types';

interface Props {
  workloads: Workload[];
  selected: Set<string>;
  onToggle: (id: string, on: boolean) => void;
  onToggleAll: (on: boolean) => void;
}

/** One row per workload (allocation), with a checkbox for the bulk actions. Live columns stay
 * empty until the metrics service's figures are present. */
export function WorkloadTable({ workloads, selected, onToggle, onToggleAll }: Props) {
  const allSelected = workloads.length > 0 && workloads.every(w => selected.has(w.id));
  return (
    <div className="table-responsive">
      <table className="table table-sm table-hover align-middle" aria-label="Workloads">
        <thead>
          <tr>
            <th scope="col">
              <input
                type="checkbox"
                aria-label="Select all shown workloads"
                checked={allSelected}
                onChange={e => onToggleAll(e.target.checked)}
              />
            </th>
            <th scope="col">Owner</th>
            <th scope="col">Kind</th>
            <th scope="col">Workload</th>
            <th scope="col">Profile</th>
            <th scope="col">GPU model</th>
            <th scope="col">Share</th>
            <th scope="col">Node / device</th>
            <th scope="col">Tier</th>
            <th scope="col">UI idle</th>
            <th scope="col">GPU idle</th>
            <th scope="col">Utilisation</th>
            <th scope="col">Memory</th>
            <th scope="col">Culling</th>
          </tr>
        </thead>
        <tbody>
          {workloads.length === 0 && (
            <tr>
              <td colSpan={14} className="text-muted">
                No workload matches.
              </td>
            </tr>
          )}
          {workloads.map(w => (
            <tr key={w.id} aria-label={`Workload ${w.id}`} data-id={w.id}>
              <td>
                <input
                  type="checkbox"
                  aria-label={`Select ${w.id}`}
                  checked={selected.has(w.id)}
                  onChange={e => onToggle(w.id, e.target.checked)}
                />
              </td>
              <td>{w.owner}</td>
              <td>{w.kind}</td>
              <td>
                {w.server ? (
                  <a href={w.server.url}>{w.server.name || 'default server'}</a>
                ) : (
                  <code>{w.id}</code>
                )}
              </td>
              <td>{w.profile ?? ''}</td>
              <td>{w.gpu_model ?? ''}</td>
              <td>{shareLabel(w)}</td>
              <td>{placeLabel(w)}</td>
              <td>
                {w.tier}
                {w.over_quota && <span className="badge text-bg-warning ms-1">over quota</span>}
              </td>
              <td>{duration(w.ui_idle_seconds)}</td>
              {w.monitored ? (
                <>
                  <td>{duration(w.gpu_idle_seconds)}</td>
                  <td>{percent(w.utilization)}</td>
                  <td>{mebibytes(w.memory_used_mib)}</td>
                </>
              ) : (
                <td
                  colSpan={3}
                  className="text-muted"
                  title="Job runs and Dask workers push no GPU figures yet"
                >
                  not monitored
                </td>
              )}
              <td title={w.culling?.reason ?? ''}>{cullingLabel(w)}</td>
            </tr>
          ))}
        </tbody>
      </table>
    </div>
  );
}
