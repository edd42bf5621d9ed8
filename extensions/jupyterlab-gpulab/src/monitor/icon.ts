import { LabIcon } from '@jupyterlab/ui-components';
import gpuSvg from '../../style/icons/gpu.svg';

export const gpuIcon = new LabIcon({ name: 'jupyterlab-gpulab:gpu', svgstr: gpuSvg });
