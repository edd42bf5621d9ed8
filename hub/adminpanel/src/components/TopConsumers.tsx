import { BarElement, CategoryScale, Chart as ChartJS, LinearScale, Tooltip } from 'chart.js';
import { Bar } from 'react-chartjs-2';

import { ownerColor } from '../colors';
import { gpuAmount } from '../format';
import type { Workload } from '../types';

ChartJS.register(CategoryScale, LinearScale, BarElement, Tooltip);

/** How many users the chart shows */
const TOP = 10;

/** Users by GPUs allocated now, largest first (GPU-hours come with the ledger). */
export function topConsumers(workloads: Workload[]): [string, number][] {
  const byOwner = new Map<string, number>();
  for (const w of workloads) {
    byOwner.set(w.owner, (byOwner.get(w.owner) ?? 0) + w.gpus);
  }
  return [...byOwner.entries()]
    .filter(([, gpus]) => gpus > 0)
    .sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]))
    .slice(0, TOP);
}

export function TopConsumers({ workloads }: { workloads: Workload[] }) {
  const top = topConsumers(workloads);
  const summary = top.map(([owner, gpus]) => `${owner}: ${gpuAmount(gpus)}`).join(', ');
  return (
    <section aria-label="Top consumers" className="mb-4" style={{ maxWidth: 640 }}>
      <h2 className="h5">Top consumers (GPUs allocated now)</h2>
      {top.length === 0 ? (
        <p className="text-muted">Nobody holds a GPU.</p>
      ) : (
        <div style={{ position: 'relative', height: Math.max(120, 36 * top.length) }}>
          <Bar
            role="img"
            aria-label={`Top consumers by allocated GPUs: ${summary}`}
            data={{
              labels: top.map(([owner]) => owner),
              datasets: [
                {
                  label: 'GPUs',
                  data: top.map(([, gpus]) => gpus),
                  backgroundColor: top.map(([owner]) => ownerColor(owner))
                }
              ]
            }}
            options={{
              indexAxis: 'y',
              animation: false,
              maintainAspectRatio: false,
              plugins: { tooltip: { callbacks: { label: item => gpuAmount(Number(item.raw)) } } },
              scales: {
                x: { beginAtZero: true, title: { display: true, text: 'GPUs' } },
                y: { ticks: { autoSkip: false } }
              }
            }}
          />
        </div>
      )}
    </section>
  );
}
