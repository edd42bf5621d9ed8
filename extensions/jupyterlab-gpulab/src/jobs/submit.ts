/**
 * "Submit as GPU job…": the open script (or notebook) on a GPU profile picked from the user's
 * profiles with what is free now, her remaining quota and GPU-hour budget. jupyter-scheduler's form covers
 * notebooks only; this covers `.py` and `.sh` scripts, with their command-line arguments.
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import { fetchBudget, IBudgetReply, showBudget } from '../budget/api';
import { IProfileChoice, IRun, listProfiles, profileSelect, submitFile } from './api';

export const SUBMITTABLE = /\.(py|sh|ipynb)$/;

class SubmitForm extends Widget {
  constructor(
    path: string,
    profiles: IProfileChoice[],
    quota: string | null,
    budget: IBudgetReply | null
  ) {
    super();
    this.addClass('gpulab-submit-form');
    this.node.dataset.testid = 'gpulab-submit-form';
    const what = document.createElement('p');
    what.textContent = `Run ${path} as a GPU job, outside this server.`;
    this._profile = profileSelect(profiles, 'job', 'gpulab-submit-profile');
    const quotaLine = document.createElement('p');
    quotaLine.textContent = quota ?? '';
    const budgetLine = document.createElement('p');
    showBudget(budgetLine, budget);
    budgetLine.dataset.testid = 'gpulab-submit-budget';
    this._args = document.createElement('input');
    this._args.className = 'jp-mod-styled';
    this._args.placeholder = 'arguments (space-separated), e.g. --epochs 3';
    this._args.dataset.testid = 'gpulab-submit-args';
    this._args.disabled = path.endsWith('.ipynb');
    this.node.append(what, this._profile, quotaLine, budgetLine, this._args);
  }

  getValue(): { profile: string; args: string[] } {
    const args = this._args.value.trim();
    return { profile: this._profile.value, args: args ? args.split(/\s+/) : [] };
  }

  private readonly _profile: HTMLSelectElement;
  private readonly _args: HTMLInputElement;
}

/** Ask for the profile and arguments, then submit; the new run, or null when canceled. */
export async function submitWithDialog(path: string): Promise<IRun | null> {
  // a budget that cannot be read is not shown: the hub still checks it when the job starts
  const [{ quota, profiles }, budget] = await Promise.all([
    listProfiles(),
    fetchBudget().catch(() => null)
  ]);
  const result = await showDialog({
    title: 'Submit as GPU job',
    body: new SubmitForm(path, profiles, quota, budget),
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Submit' })]
  });
  if (!result.button.accept || !result.value) {
    return null;
  }
  const { profile, args } = result.value;
  return submitFile(path.endsWith('.ipynb') ? { path, profile } : { path, profile, args });
}
