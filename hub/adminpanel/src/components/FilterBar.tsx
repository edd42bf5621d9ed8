import type { Filters } from '../filters';

interface Props {
  filters: Filters;
  onChange: (filters: Filters) => void;
}

/** The table's filters: text (owner or kind), GPU idle longer than N minutes, over quota,
 * preemptible. */
export function FilterBar({ filters, onChange }: Props) {
  return (
    <form
      className="row g-2 align-items-center mb-2"
      role="search"
      aria-label="Filter workloads"
      onSubmit={e => e.preventDefault()}
    >
      <div className="col-auto">
        <input
          className="form-control form-control-sm"
          type="search"
          placeholder="owner or kind"
          aria-label="Filter by owner or kind"
          value={filters.text}
          onChange={e => onChange({ ...filters, text: e.target.value })}
        />
      </div>
      <div className="col-auto">
        <label className="form-label mb-0 small">
          GPU idle &gt;{' '}
          <input
            className="form-control form-control-sm d-inline"
            style={{ width: '6em' }}
            type="number"
            min={0}
            aria-label="GPU idle longer than minutes"
            value={filters.gpuIdleMinutes}
            onChange={e => onChange({ ...filters, gpuIdleMinutes: e.target.value })}
          />{' '}
          min
        </label>
      </div>
      <div className="col-auto form-check">
        <label className="form-check-label">
          <input
            className="form-check-input"
            type="checkbox"
            checked={filters.overQuota}
            onChange={e => onChange({ ...filters, overQuota: e.target.checked })}
          />{' '}
          Over quota
        </label>
      </div>
      <div className="col-auto form-check">
        <label className="form-check-label">
          <input
            className="form-check-input"
            type="checkbox"
            checked={filters.preemptible}
            onChange={e => onChange({ ...filters, preemptible: e.target.checked })}
          />{' '}
          Preemptible
        </label>
      </div>
    </form>
  );
}
