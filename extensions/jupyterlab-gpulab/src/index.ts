/**
 * jupyterlab-gpulab: gpulab's JupyterLab extension.
 *
 * Each feature lives in its own folder and exports its plugins; this file only lists them.
 * Today: the GPU monitor (`monitor/`), the GPU jobs panel (`jobs/`) and the "New GPU cluster"
 * dialog (`dask/`; dask-labextension's sidebar lists the clusters), and GPU-aware culling's input
 * reports and warnings (`culling/`).
 */
import { JupyterFrontEndPlugin } from '@jupyterlab/application';
import { cullingPlugin } from './culling/plugin';
import { daskPlugin } from './dask/plugin';
import { jobsPlugin } from './jobs/plugin';
import { monitorPlugin, statusPlugin } from './monitor/plugin';

export { IGpuMonitor } from './monitor/token';

const plugins: JupyterFrontEndPlugin<any>[] = [
  monitorPlugin,
  statusPlugin,
  jobsPlugin,
  daskPlugin,
  cullingPlugin
];

export default plugins;
