import {
  CategoryScale,
  Chart as ChartJS,
  LinearScale,
  LineElement,
  PointElement,
  Tooltip
} from 'chart.js';
import { useCallback, useEffect, useState } from 'react';
import { Line } from 'react-chartjs-2';

import { fetchBudgets, gpuHours, overQuota, type BudgetInfo, type Budgets } from '../gpuHours';

ChartJS.register(CategoryScale, LinearScale, LineElement, PointElement, Tooltip);

const REFRESH_MS = 60_000;
const STATE_BADGE: Record<BudgetInfo['state'], string> = {
  ok: 'text-bg-success',
  warn: 'text-bg-warning',
  exhausted: 'text-bg-danger'
};

function budgetName(b: BudgetInfo): string {
  return b.scope === 'user' ? `user ${b.name}` : `group ${b.name}`;
}

/** GPU-hours left at each day of the window, as a small line */
function BurnDown({ budget }: { budget: BudgetInfo }) {
  const points = budget.burn_down;
  const last = points[points.length - 1];
  return (
    <div style={{ position: 'relative', width: 260, height: 70 }}>
      <Line
        role="img"
        aria-label={`Burn-down of ${budgetName(budget)}: ${gpuHours(points[0]?.remaining_gpu_hours ?? 0)} to ${gpuHours(last?.remaining_gpu_hours ?? 0)} GPU-hours left over ${points.length} points`}
        data={{
          labels: points.map(p => p.t.slice(0, 10)),
          datasets: [
            {
              label: 'GPU-hours left',
              data: points.map(p => p.remaining_gpu_hours),
              borderColor: budget.state === 'ok' ? '#198754' : '#dc3545',
              pointRadius: 1,
              borderWidth: 2
            }
          ]
        }}
        options={{
          animation: false,
          maintainAspectRatio: false,
          plugins: {
            legend: { display: false },
            tooltip: { callbacks: { label: item => gpuHours(Number(item.raw)) } }
          },
          scales: {
            x: { display: false },
            y: { beginAtZero: true, max: budget.limit_gpu_hours, ticks: { maxTicksLimit: 3 } }
          }
        }}
      />
    </div>
  );
}

/** Every configured GPU-hour budget: limit, allocated in the window, left, state, burn-down. */
export function BudgetsSection({ apiUrl }: { apiUrl: string }) {
  const [data, setData] = useState<Budgets | null>(null);
  const [error, setError] = useState<string | null>(null);
  const [onlyOver, setOnlyOver] = useState(false);

  const refresh = useCallback(async () => {
    try {
      setData(await fetchBudgets(apiUrl));
      setError(null);
    } catch (e) {
      setError(`Could not read the GPU-hour budgets: ${(e as Error).message}`);
    }
  }, [apiUrl]);

  useEffect(() => {
    void refresh();
    const timer = window.setInterval(() => void refresh(), REFRESH_MS);
    return () => window.clearInterval(timer);
  }, [refresh]);

  const budgets = data ? (onlyOver ? overQuota(data.budgets) : data.budgets) : [];
  return (
    <section aria-label="GPU-hour budgets" className="mb-4">
      <h2 className="h5">
        GPU-hour budgets
        {data && (
          <span className="small text-muted">
            {' '}
            (last {data.window.days} days, warning at {data.window.warn_percent} %)
          </span>
        )}
      </h2>
      {error && (
        <div className="alert alert-danger" role="alert">
          {error}
        </div>
      )}
      {data && data.budgets.length === 0 && (
        <p className="text-muted">
          No GPU-hour budget is configured (GPULedger.hour_quota_users, hour_quota_groups).
        </p>
      )}
      {data && data.budgets.length > 0 && (
        <>
          <div className="form-check mb-2">
            <input
              className="form-check-input"
              type="checkbox"
              id="gpulab-budgets-over"
              checked={onlyOver}
              onChange={e => setOnlyOver(e.target.checked)}
            />
            <label className="form-check-label" htmlFor="gpulab-budgets-over">
              Over quota only (warn or exhausted)
            </label>
          </div>
          <table className="table table-sm align-middle" aria-label="Budgets">
            <thead>
              <tr>
                <th>Budget</th>
                <th className="text-end">Limit</th>
                <th className="text-end">Allocated</th>
                <th className="text-end">Left</th>
                <th>State</th>
                <th>Burn-down (GPU-hours left)</th>
              </tr>
            </thead>
            <tbody>
              {budgets.map(b => (
                <tr key={`${b.scope}:${b.name}`} aria-label={`Budget ${budgetName(b)}`}>
                  <td>
                    {budgetName(b)}
                    {b.scope === 'group' && b.users.length > 0 && (
                      <div className="small text-muted">{b.users.join(', ')}</div>
                    )}
                  </td>
                  <td className="text-end">{gpuHours(b.limit_gpu_hours)}</td>
                  <td className="text-end">{gpuHours(b.allocated_gpu_hours)}</td>
                  <td className="text-end">{gpuHours(b.remaining_gpu_hours)}</td>
                  <td>
                    <span className={`badge ${STATE_BADGE[b.state]}`}>{b.state}</span>
                  </td>
                  <td>
                    <BurnDown budget={b} />
                  </td>
                </tr>
              ))}
            </tbody>
          </table>
        </>
      )}
    </section>
  );
}
