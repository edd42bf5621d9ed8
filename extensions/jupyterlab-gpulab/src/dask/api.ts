/**
 * The server extension's Dask API (under `<base_url>/gpulab/dask/`): the server creates the
 * cluster through the hub with its own token (the page holds no hub token), and
 * dask-labextension's sidebar lists it from the hub.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** dask-labextension's cluster model, with gpulab's fields. */
export interface IClusterModel {
  id: string;
  name: string;
  hub_id: number;
  state: string;
  profile: string;
  keep_alive: boolean;
  target_workers: number;
  waiting_reason: string | null;
  dashboard_link: string;
}

export interface INewCluster {
  profile: string;
  n_workers: number;
  keep_alive: boolean;
  name?: string;
}

/** Ask the hub, through this server, for a new cluster; the hub's refusal (its quota message,
 * or the field it names) becomes the error's message. */
export async function createCluster(body: INewCluster): Promise<IClusterModel> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'gpulab/dask/clusters');
  const response = await ServerConnection.makeRequest(
    url,
    { method: 'POST', body: JSON.stringify(body) },
    settings
  );
  const text = await response.text();
  const answer = text ? JSON.parse(text) : {};
  if (!response.ok) {
    throw new Error(answer.message || `${response.status} ${response.statusText}`);
  }
  return answer as IClusterModel;
}
