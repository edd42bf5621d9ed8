/** The Dask plugin: "New GPU Cluster…" (palette, launcher); dask-labextension's sidebar then
 * lists the cluster, which the server's manager reads from the hub. */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, Notification } from '@jupyterlab/apputils';
import { ILauncher } from '@jupyterlab/launcher';
import { gpuIcon } from '../monitor/icon';
import { newClusterWithDialog } from './dialog';

export namespace DaskCommandIDs {
  export const create = 'gpulab:new-gpu-cluster';
}

/** dask-labextension's sidebar (its widget id). */
const DASK_SIDEBAR = 'dask-dashboard-launcher';

export const daskPlugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyterlab-gpulab:dask',
  description: 'New GPU cluster: a Dask cluster the hub runs, on a GPU profile you pick.',
  autoStart: true,
  optional: [ICommandPalette, ILauncher],
  activate: (app: JupyterFrontEnd, palette: ICommandPalette | null, launcher: ILauncher | null) => {
    app.commands.addCommand(DaskCommandIDs.create, {
      label: args => (args.isPalette ? 'New GPU Cluster…' : 'GPU Cluster'),
      caption: 'A Dask cluster of GPU workers, run by the hub, listed in the Dask sidebar',
      icon: args => (args.isPalette ? undefined : gpuIcon),
      execute: async () => {
        try {
          const cluster = await newClusterWithDialog();
          if (cluster) {
            const waiting = cluster.waiting_reason ? `: ${cluster.waiting_reason}` : '';
            Notification.info(`Dask cluster ${cluster.name} is ${cluster.state}${waiting}`, {
              autoClose: 10000
            });
            app.shell.activateById(DASK_SIDEBAR);
          }
        } catch (reason) {
          Notification.error(`Dask cluster not created: ${(reason as Error).message ?? reason}`, {
            autoClose: false
          });
        }
      }
    });
    palette?.addItem({
      command: DaskCommandIDs.create,
      category: 'GPU',
      args: { isPalette: true }
    });
    launcher?.add({ command: DaskCommandIDs.create, category: 'Other', rank: 3 });
  }
};
