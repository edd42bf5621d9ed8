/** The GPU monitor's plugins: the panel (command, palette, launcher, GPU menu) and the status bar item. */
import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, WidgetTracker } from '@jupyterlab/apputils';
import { ILauncher } from '@jupyterlab/launcher';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';
import { notifyAlert } from './alerts';
import { gpuIcon } from './icon';
import { DEFAULT_OPTIONS, IMonitorOptions, MonitorModel } from './model';
import { GpuMonitorPanel } from './panel';
import { GpuStatusItem } from './status';
import { CommandIDs, IGpuMonitor } from './token';

/** Its settings are schema/monitor.json, which also declares the "GPU" main menu. */
export const monitorPlugin: JupyterFrontEndPlugin<IGpuMonitor> = {
  id: 'jupyterlab-gpulab:monitor',
  description:
    'GPU monitor panel: your share, live utilisation and memory, processes, alert rules.',
  autoStart: true,
  provides: IGpuMonitor,
  optional: [ICommandPalette, ILauncher, ILayoutRestorer, ISettingRegistry],
  activate: (
    app: JupyterFrontEnd,
    palette: ICommandPalette | null,
    launcher: ILauncher | null,
    restorer: ILayoutRestorer | null,
    settingRegistry: ISettingRegistry | null
  ): IGpuMonitor => {
    const model = new MonitorModel();
    const tracker = new WidgetTracker<GpuMonitorPanel>({ namespace: 'gpulab-monitor' });
    let panel: GpuMonitorPanel | null = null;
    let notify = true;

    const open = () => {
      if (!panel || panel.isDisposed) {
        panel = new GpuMonitorPanel(model);
        void tracker.add(panel);
      }
      if (!panel.isAttached) {
        app.shell.add(panel, 'main');
      }
      app.shell.activateById(panel.id);
    };

    app.commands.addCommand(CommandIDs.open, {
      label: 'GPU Monitor',
      caption: 'Your GPU share: live utilisation and memory, processes, alert rules',
      icon: args => (args.isPalette ? undefined : gpuIcon),
      execute: open
    });
    palette?.addItem({ command: CommandIDs.open, category: 'GPU' });
    launcher?.add({ command: CommandIDs.open, category: 'Other', rank: 1 });
    if (restorer) {
      void restorer.restore(tracker, { command: CommandIDs.open, name: () => 'gpulab-monitor' });
    }

    model.alertReceived.connect((_, event) => {
      if (notify) {
        notifyAlert(event, open);
      }
    });

    const applySettings = (settings: ISettingRegistry.ISettings) => {
      const c = settings.composite as Partial<IMonitorOptions> & { notifyAlerts?: boolean };
      model.setOptions({
        refreshRateHz: Number(c.refreshRateHz ?? DEFAULT_OPTIONS.refreshRateHz),
        historySeconds: Number(c.historySeconds ?? DEFAULT_OPTIONS.historySeconds)
      });
      notify = c.notifyAlerts ?? true;
    };
    const settingsLoaded = settingRegistry
      ? settingRegistry
          .load(monitorPlugin.id)
          .then(settings => {
            applySettings(settings);
            settings.changed.connect(applySettings);
          })
          .catch(reason =>
            console.warn('gpulab: GPU monitor settings not loaded, using defaults', reason)
          )
      : Promise.resolve();

    void Promise.all([app.restored, settingsLoaded]).then(() => model.start());
    return { model, open };
  }
};

export const statusPlugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyterlab-gpulab:monitor-status',
  description: 'Status bar item with the GPU share’s current utilisation and memory.',
  autoStart: true,
  requires: [IGpuMonitor],
  optional: [IStatusBar],
  activate: (app: JupyterFrontEnd, monitor: IGpuMonitor, statusBar: IStatusBar | null) => {
    if (!statusBar) {
      return;
    }
    statusBar.registerStatusItem(statusPlugin.id, {
      item: new GpuStatusItem(monitor.model, monitor.open),
      align: 'left',
      rank: 10
    });
  }
};
