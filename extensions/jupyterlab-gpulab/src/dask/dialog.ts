/**
 * "New GPU cluster…": a Dask cluster the hub owns, on a profile picked from the user's profiles
 * (what is free now, her quota), with its workers and whether it outlives this server.
 * dask-labextension's own "+NEW" cannot say which profile (its create call has no body).
 */
import { Dialog, showDialog } from '@jupyterlab/apputils';
import { Widget } from '@lumino/widgets';
import { IProfileChoice, listProfiles, profileSelect } from '../jobs/api';
import { createCluster, IClusterModel, INewCluster } from './api';

/** The most workers the form offers (the hub refuses what the quota does not allow). */
const MAX_WORKERS = 64;

class NewClusterForm extends Widget {
  constructor(profiles: IProfileChoice[], quota: string | null) {
    super();
    this.addClass('gpulab-dask-form');
    this.node.dataset.testid = 'gpulab-dask-form';
    const what = document.createElement('p');
    what.textContent =
      'A Dask cluster run by the hub: each worker gets a share of the profile, admitted like a server.';
    this._profile = profileSelect(profiles, 'dask', 'gpulab-dask-profile');
    const quotaLine = document.createElement('p');
    quotaLine.textContent = quota ?? '';
    this._workers = document.createElement('input');
    this._workers.type = 'number';
    this._workers.min = '0';
    this._workers.max = String(MAX_WORKERS);
    this._workers.value = '2';
    this._workers.className = 'jp-mod-styled';
    this._workers.dataset.testid = 'gpulab-dask-workers';
    this._name = document.createElement('input');
    this._name.className = 'jp-mod-styled';
    this._name.placeholder = 'name (optional; find it again by name from any server)';
    this._name.dataset.testid = 'gpulab-dask-name';
    this._keepAlive = document.createElement('input');
    this._keepAlive.type = 'checkbox';
    this._keepAlive.dataset.testid = 'gpulab-dask-keep-alive';
    const keepLabel = document.createElement('label');
    keepLabel.append(
      this._keepAlive,
      ' Keep alive after this server stops (it still stops when idle)'
    );
    this.node.append(
      what,
      labelled('Profile', this._profile),
      quotaLine,
      labelled('Workers', this._workers),
      labelled('Name', this._name),
      keepLabel
    );
  }

  getValue(): INewCluster {
    const body: INewCluster = {
      profile: this._profile.value,
      n_workers: Number(this._workers.value),
      keep_alive: this._keepAlive.checked
    };
    const name = this._name.value.trim();
    if (name) {
      body.name = name;
    }
    return body;
  }

  private readonly _profile: HTMLSelectElement;
  private readonly _workers: HTMLInputElement;
  private readonly _name: HTMLInputElement;
  private readonly _keepAlive: HTMLInputElement;
}

function labelled(text: string, input: HTMLElement): HTMLElement {
  const label = document.createElement('label');
  label.className = 'gpulab-dask-field';
  label.append(`${text} `, input);
  return label;
}

/** Ask for profile, workers and keep-alive, then create; the new cluster, or null if canceled. */
export async function newClusterWithDialog(): Promise<IClusterModel | null> {
  const { quota, profiles } = await listProfiles();
  const result = await showDialog({
    title: 'New GPU cluster',
    body: new NewClusterForm(profiles, quota),
    buttons: [Dialog.cancelButton(), Dialog.okButton({ label: 'Create' })]
  });
  if (!result.button.accept || !result.value) {
    return null;
  }
  return createCluster(result.value);
}
