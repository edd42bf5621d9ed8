import { ownerColor } from '../colors';
import { gpuAmount } from '../format';
import type { NodeInfo } from '../types';

/** Each node's GPUs as boxes, each filled by the shares placed on it (width = share of the
 * device's capacity). */
export function GpuMap({ nodes }: { nodes: NodeInfo[] }) {
  return (
    <section aria-label="GPU map" className="mb-4">
      <h2 className="h5">GPU map</h2>
      {nodes.map(node => (
        <div key={node.name} role="group" aria-label={`Node ${node.name}`} className="mb-2">
          <div className="small fw-bold">{node.name}</div>
          <div className="d-flex flex-wrap gap-2">
            {node.gpus.map(gpu => {
              const used = gpu.shares.reduce((sum, s) => sum + s.milli, 0);
              const title = `GPU ${gpu.index} ${gpu.model}${gpu.mig_profile ? ' MIG ' + gpu.mig_profile : ''}`;
              return (
                <div
                  key={gpu.uuid}
                  role="img"
                  aria-label={`${title}: ${gpuAmount(used / 1000)} of ${gpuAmount(gpu.capacity_milli / 1000)} in use`}
                  title={title}
                  style={{ width: 120, border: '1px solid #888', borderRadius: 4, padding: 2 }}
                >
                  <div className="small text-truncate">
                    {gpu.index}: {gpu.model}
                  </div>
                  <div style={{ display: 'flex', height: 16, background: '#eee' }}>
                    {gpu.shares.map(share => (
                      <div
                        key={share.id}
                        title={`${share.id} (${share.owner}): ${gpuAmount(share.milli / 1000)}`}
                        style={{
                          width: `${(100 * share.milli) / gpu.capacity_milli}%`,
                          background: ownerColor(share.owner),
                          borderRight: '1px solid white'
                        }}
                      />
                    ))}
                  </div>
                </div>
              );
            })}
          </div>
        </div>
      ))}
    </section>
  );
}
