/** The GPU jobs plugin: the panel (command, palette, launcher) and a notification when a run ends. */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, Notification, WidgetTracker } from '@jupyterlab/apputils';
import { ILauncher } from '@jupyterlab/launcher';
import { gpuIcon } from '../monitor/icon';
import { JobsModel } from './model';
import { GpuJobsPanel } from './panel';
import { SUBMITTABLE, submitWithDialog } from './submit';

export namespace JobCommandIDs {
  export const open = 'gpulab:open-gpu-jobs';
  export const submit = 'gpulab:submit-gpu-job';
}

/** The path of the open document (an editor or a notebook), if it is one a job can run. */
function currentPath(app: JupyterFrontEnd): string | null {
  const path = (app.shell.currentWidget as { context?: { path?: string } } | null)?.context?.path;
  return path && SUBMITTABLE.test(path) ? path : null;
}

export const jobsPlugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyterlab-gpulab:jobs',
  description: 'GPU jobs panel: queue position, state, attempts, live logs, outputs, TensorBoard.',
  autoStart: true,
  optional: [ICommandPalette, ILauncher, ILayoutRestorer],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    launcher: ILauncher | null,
    restorer: ILayoutRestorer | null
  ) => {
    const model = new JobsModel();
    const tracker = new WidgetTracker<GpuJobsPanel>({ namespace: 'gpulab-jobs' });
    let panel: GpuJobsPanel | null = null;
    const openPath = (path: string) => void app.commands.execute('docmanager:open', { path });

    const open = (args?: { run?: number }) => {
      if (!panel || panel.isDisposed) {
        panel = new GpuJobsPanel(model, openPath);
        void tracker.add(panel);
      }
      if (!panel.isAttached) {
        app.shell.add(panel, 'main');
      }
      app.shell.activateById(panel.id);
      if (args?.run !== undefined) {
        panel.select(args.run);
      }
    };
    app.commands.addCommand(JobCommandIDs.open, {
      label: 'GPU Jobs',
      caption: 'Your GPU job runs: queue, state, logs, outputs, TensorBoard',
      icon: args => (args.isPalette ? undefined : gpuIcon),
      execute: args => open(args as { run?: number })
    });
    palette?.addItem({ command: JobCommandIDs.open, category: 'GPU' });
    app.commands.addCommand(JobCommandIDs.submit, {
      label: 'Submit as GPU Job…',
      caption: 'Run the open script or notebook as a GPU job on a profile you pick',
      isEnabled: () => currentPath(app) !== null,
      execute: async () => {
        const path = currentPath(app);
        if (!path) {
          return;
        }
        try {
          const run = await submitWithDialog(path);
          if (run) {
            Notification.info(`GPU job ${run.spec.name} #${run.id}: ${run.status_message}`, {
              autoClose: 10000
            });
            open({ run: run.id });
            await model.refresh();
          }
        } catch (reason) {
          Notification.error(`GPU job not submitted: ${(reason as Error).message ?? reason}`, {
            autoClose: false
          });
        }
      }
    });
    palette?.addItem({ command: JobCommandIDs.submit, category: 'GPU' });
    launcher?.add({ command: JobCommandIDs.open, category: 'Other', rank: 2 });
    if (restorer) {
      void restorer.restore(tracker, { command: JobCommandIDs.open, name: () => 'gpulab-jobs' });
    }

    model.ended.connect((_, run) => {
      const what = `GPU job ${run.spec.name} #${run.id} ${run.state.replace('_', ' ')}`;
      const message = run.reason ? `${what}: ${run.reason}` : what;
      const options = {
        autoClose: 20000 as const,
        actions: [{ label: 'Show run', callback: () => open({ run: run.id }) }]
      };
      if (run.state === 'succeeded') {
        Notification.success(message, options);
      } else if (run.state === 'canceled') {
        Notification.info(message, options);
      } else {
        Notification.error(message, options);
      }
    });
    void app.restored.then(() => model.start());
  }
};
