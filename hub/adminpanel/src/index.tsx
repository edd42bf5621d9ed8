/** The GPU admin panel's entry point: mounts the app on the page's #gpulab-admin-root
 * (hub/templates/gpulab-admin.html), which names the REST API's address. */

import { createRoot } from 'react-dom/client';

import { App } from './App';

const root = document.getElementById('gpulab-admin-root');
if (root) {
  createRoot(root).render(<App apiUrl={root.dataset.apiUrl ?? '/hub/api/gpulab/admin/'} />);
}
