import {
  BarElement,
  CategoryScale,
  Chart as ChartJS,
  Legend,
  LinearScale,
  Tooltip
} from 'chart.js';
import { useCallback, useEffect, useState } from 'react';
import { Bar } from 'react-chartjs-2';

import {
  consumers,
  fetchUsageByUser,
  gpuHours,
  usageCsvUrl,
  WINDOWS,
  windowStart,
  type Consumer
} from '../gpuHours';

ChartJS.register(CategoryScale, LinearScale, BarElement, Tooltip, Legend);

/** How many users the chart shows */
const TOP = 10;
/** How often the figures are read again (GPU-hours move slowly) */
const REFRESH_MS = 60_000;
const USED_COLOR = 'hsl(140, 55%, 45%)';
const IDLE_COLOR = 'hsl(30, 85%, 60%)';
const UNMONITORED_COLOR = 'hsl(220, 10%, 70%)';

/** Users by GPU-hours over a chosen window: used, idle and unmonitored (external GPU pods,
 * which report no GPU figures) stacked, together what each was allocated; and the
 * server's CSV of the same window. */
export function TopConsumers({ apiUrl }: { apiUrl: string }) {
  const [windowKey, setWindowKey] = useState('7d');
  const [since, setSince] = useState(() => windowStart('7d'));
  const [top, setTop] = useState<Consumer[] | null>(null);
  const [error, setError] = useState<string | null>(null);

  const refresh = useCallback(async () => {
    const start = windowStart(windowKey);
    try {
      const usage = await fetchUsageByUser(apiUrl, start);
      setSince(start);
      setTop(consumers(usage.rows, TOP));
      setError(null);
    } catch (e) {
      setError(`Could not read GPU-hours: ${(e as Error).message}`);
    }
  }, [apiUrl, windowKey]);

  useEffect(() => {
    void refresh();
    const timer = window.setInterval(() => void refresh(), REFRESH_MS);
    return () => window.clearInterval(timer);
  }, [refresh]);

  const label = WINDOWS[windowKey].label;
  const summary = (top ?? [])
    .map(
      c =>
        `${c.user}: ${gpuHours(c.allocated)} allocated, ${gpuHours(c.used)} used, ${gpuHours(c.idle)} idle, ${gpuHours(c.unmonitored)} unmonitored`
    )
    .join('; ');
  return (
    <section aria-label="Top consumers" className="mb-4" style={{ maxWidth: 720 }}>
      <h2 className="h5">Top consumers (GPU-hours, {label})</h2>
      <div className="d-flex gap-2 align-items-center mb-2">
        <label className="small" htmlFor="gpulab-usage-window">
          Window
        </label>
        <select
          id="gpulab-usage-window"
          className="form-select form-select-sm w-auto"
          aria-label="GPU-hours window"
          value={windowKey}
          onChange={e => setWindowKey(e.target.value)}
        >
          {Object.entries(WINDOWS).map(([key, w]) => (
            <option key={key} value={key}>
              {w.label}
            </option>
          ))}
        </select>
        <a
          className="btn btn-sm btn-outline-secondary"
          href={usageCsvUrl(apiUrl, since)}
          download="gpu-hours.csv"
        >
          Export GPU-hours CSV
        </a>
      </div>
      {error && (
        <div className="alert alert-danger" role="alert">
          {error}
        </div>
      )}
      {top === null ? null : top.length === 0 ? (
        <p className="text-muted">No GPU-hours in the {label}.</p>
      ) : (
        <div style={{ position: 'relative', height: Math.max(140, 36 * top.length + 40) }}>
          <Bar
            role="img"
            aria-label={`Top consumers by GPU-hours (${label}): ${summary}`}
            data={{
              labels: top.map(c => c.user),
              datasets: [
                {
                  label: 'Used GPU-hours',
                  data: top.map(c => c.used),
                  backgroundColor: USED_COLOR
                },
                {
                  label: 'Idle GPU-hours',
                  data: top.map(c => c.idle),
                  backgroundColor: IDLE_COLOR
                },
                {
                  label: 'Unmonitored GPU-hours (external GPU pods)',
                  data: top.map(c => c.unmonitored),
                  backgroundColor: UNMONITORED_COLOR
                }
              ]
            }}
            options={{
              indexAxis: 'y',
              animation: false,
              maintainAspectRatio: false,
              plugins: {
                tooltip: {
                  callbacks: {
                    label: item => `${item.dataset.label}: ${gpuHours(Number(item.raw))}`,
                    footer: items =>
                      `Allocated: ${gpuHours(top[items[0]?.dataIndex ?? 0]?.allocated ?? 0)}`
                  }
                }
              },
              scales: {
                x: {
                  stacked: true,
                  beginAtZero: true,
                  title: { display: true, text: 'GPU-hours allocated (used + idle + unmonitored)' }
                },
                y: { stacked: true, ticks: { autoSkip: false } }
              }
            }}
          />
        </div>
      )}
    </section>
  );
}
