/**
 * GPU-aware culling in JupyterLab: reports the user's real input to the server (which tells the
 * hub), and shows the hub's warning before an idle GPU server is culled, with "Keep alive" and
 * "Switch to CPU".
 *
 * Real input only: keys and clicks in the lab's shell, cells run (the notebook and console run
 * commands), keys in a terminal. The GPU panel's polling, this plugin's own polling and any other
 * background request never count, so an abandoned lab with the GPU panel open is culled.
 */
import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { Notification } from '@jupyterlab/apputils';
import { CullingAPI, IBudgetNotice, ICullWarning, InputKind } from './api';

/** At most one report of each kind this often: input is kept to the second, not per key. */
const INPUT_THROTTLE_MS = 2000;
const MIN_POLL_MS = 1000;
const MAX_POLL_MS = 60000;

function isCellRun(command: string): boolean {
  return (
    command.startsWith('notebook:run') ||
    command.startsWith('console:run') ||
    command === 'runmenu:run' ||
    command.startsWith('runmenu:run')
  );
}

const ACTION_WORDS: { [action: string]: string } = {
  stop: 'stopped',
  'checkpoint-stop': 'stopped (its variables are checkpointed; %gpulab_restore brings them back)',
  downsize: 'moved to CPU only'
};

function warningMessage(warning: ICullWarning): string {
  const minutes = Math.max(0, Math.ceil(warning.seconds_left / 60));
  const when = warning.seconds_left < 60 ? 'in less than a minute' : `in ${minutes} min`;
  const what = ACTION_WORDS[warning.action] ?? 'stopped';
  return `Idle GPU server: it will be ${what} ${when} unless you use it. ${warning.reason}`;
}

export const cullingPlugin: JupyterFrontEndPlugin<void> = {
  id: 'jupyterlab-gpulab:culling',
  description: 'Reports real input for GPU-aware culling and shows its warnings.',
  autoStart: true,
  activate: (app: JupyterFrontEnd) => {
    const api = new CullingAPI();
    const lastSent: { [kind: string]: number } = {};
    let notificationId: string | null = null;
    let deadline: number | null = null;

    const report = (kind: InputKind) => {
      const now = Date.now();
      if (now - (lastSent[kind] ?? 0) < INPUT_THROTTLE_MS) {
        return;
      }
      lastSent[kind] = now;
      api.input(kind).catch(() => {
        lastSent[kind] = 0; // the next input tries again
      });
    };

    const inTerminal = (target: EventTarget | null) =>
      target instanceof Element && target.closest('.jp-Terminal') !== null;
    app.shell.node.addEventListener(
      'keydown',
      event => report(inTerminal(event.target) ? 'terminal-input' : 'ui-input'),
      true
    );
    app.shell.node.addEventListener('pointerdown', () => report('ui-input'), true);
    app.commands.commandExecuted.connect((_, args) => {
      if (isCellRun(args.id)) {
        report('kernel-execute');
      }
    });

    const withdraw = () => {
      if (notificationId !== null) {
        Notification.dismiss(notificationId);
        notificationId = null;
        deadline = null;
      }
    };

    const show = (warning: ICullWarning) => {
      const actions: Notification.IAction[] = [
        {
          label: 'Keep alive',
          caption: `Keep this server for ${Math.round(warning.keep_alive_seconds / 3600)} h more`,
          displayType: 'accent',
          callback: () => {
            withdraw();
            api
              .keepAlive()
              .then(() =>
                Notification.info('Kept alive: this server will not be culled for now', {
                  autoClose: 5000
                })
              )
              .catch(reason =>
                Notification.error(`Keep alive failed: ${reason.message ?? reason}`)
              );
          }
        }
      ];
      if (warning.switch_to_cpu) {
        actions.push({
          label: 'Switch to CPU',
          caption: `Restart this server on ${warning.switch_to_cpu} now (its kernels stop)`,
          callback: () => {
            withdraw();
            api
              .switchToCpu()
              .then(message => Notification.info(message, { autoClose: 10000 }))
              .catch(reason =>
                Notification.error(`Switch to CPU failed: ${reason.message ?? reason}`)
              );
          }
        });
      }
      const message = warningMessage(warning);
      if (notificationId === null || deadline !== warning.deadline) {
        withdraw();
        notificationId = Notification.warning(message, { autoClose: false, actions });
        deadline = warning.deadline;
      } else {
        Notification.update({
          id: notificationId,
          message,
          type: 'warning',
          autoClose: false,
          actions
        });
      }
    };

    // the GPU-hour budget's notice: shown once per state (past 80 %, used up), gone when the
    // window frees hours again
    let budgetNotice: { id: string; state: string } | null = null;
    const showBudget = (notice: IBudgetNotice | null) => {
      if (notice === null) {
        if (budgetNotice !== null) {
          Notification.dismiss(budgetNotice.id);
          budgetNotice = null;
        }
        return;
      }
      if (budgetNotice?.state === notice.state) {
        return;
      }
      if (budgetNotice !== null) {
        Notification.dismiss(budgetNotice.id);
      }
      const show = notice.state === 'exhausted' ? Notification.error : Notification.warning;
      budgetNotice = { id: show(notice.message, { autoClose: false }), state: notice.state };
    };

    const poll = async () => {
      let next = MAX_POLL_MS / 4;
      try {
        const state = await api.state();
        next = Math.min(MAX_POLL_MS, Math.max(MIN_POLL_MS, state.poll_seconds * 1000));
        if (state.warning) {
          show(state.warning);
        } else {
          withdraw();
        }
        showBudget(state.budget_notice);
        if (!state.reporting) {
          return; // not under a hub: nothing will ever warn
        }
      } catch {
        // the server restarting: try again later
      }
      window.setTimeout(() => void poll(), next);
    };
    void app.restored.then(() => poll());
  }
};
