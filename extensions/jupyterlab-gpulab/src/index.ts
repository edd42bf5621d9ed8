/**
 * jupyterlab-gpulab: gpulab's JupyterLab extension.
 *
 * Each feature lives in its own folder and exports its plugins; this file only lists them.
 * Today: the GPU monitor (`monitor/`). Job submission and the Dask panel will join here.
 */
import { JupyterFrontEndPlugin } from '@jupyterlab/application';
import { monitorPlugin, statusPlugin } from './monitor/plugin';

export { IGpuMonitor } from './monitor/token';

const plugins: JupyterFrontEndPlugin<any>[] = [monitorPlugin, statusPlugin];

export default plugins;
