/**
 * A uPlot time-series chart in a Lumino widget that follows its container's width.
 * `data-points` on the node tells how many samples it draws (for people reading the DOM,
 * and for the browser test).
 */
import { Widget } from '@lumino/widgets';
import uPlot from 'uplot';

export interface ISeriesSpec {
  label: string;
  /** CSS colour or a JupyterLab CSS variable name such as `--jp-brand-color1`. */
  stroke: string;
  dash?: number[];
  unit: string;
  digits: number;
}

export interface ITimeChartOptions {
  testId: string;
  title: string;
  series: ISeriesSpec[];
  /** The y range, called with the data's maximum. */
  yRange: (dataMax: number) => [number, number];
  height?: number;
}

export class TimeChart extends Widget {
  constructor(private readonly _opts: ITimeChartOptions) {
    super();
    this.addClass('gpulab-chart');
    this.node.dataset.testid = _opts.testId;
    this.node.dataset.points = '0';
    const title = document.createElement('div');
    title.className = 'gpulab-chart-title';
    title.textContent = _opts.title;
    this._plotHost = document.createElement('div');
    this._plotHost.className = 'gpulab-chart-plot';
    this.node.append(title, this._plotHost);
    this._resize = new ResizeObserver(() => this._fit());
    // colours are read from the theme's CSS variables when the plot is made: remake it when the
    // theme changes (JupyterLab marks the body with data-jp-theme-name)
    this._theme = new MutationObserver(() => this._recreate());
    this._data = [[], ..._opts.series.map(() => [])] as uPlot.AlignedData;
  }

  /** `x` in unix seconds; one array per series, `null` for a gap. */
  setData(x: number[], ys: (number | null)[][]): void {
    this._data = [x, ...ys] as uPlot.AlignedData;
    this.node.dataset.points = String(x.length);
    this._plot?.setData(this._data);
  }

  protected onAfterAttach(): void {
    this._create();
    this._resize.observe(this.node);
    this._theme.observe(document.body, {
      attributes: true,
      attributeFilter: ['data-jp-theme-name', 'data-jp-theme-light']
    });
  }

  protected onBeforeDetach(): void {
    this._stop();
  }

  dispose(): void {
    this._stop();
    super.dispose();
  }

  private _stop(): void {
    this._resize.disconnect();
    this._theme.disconnect();
    this._plot?.destroy();
    this._plot = null;
  }

  private _recreate(): void {
    if (this._plot) {
      this._plot.destroy();
      this._plot = null;
      // the theme's stylesheet may still be loading; read the colours once it applies
      window.requestAnimationFrame(() => {
        if (this.isAttached && !this._plot) {
          this._create();
        }
      });
    }
  }

  private _create(): void {
    const css = getComputedStyle(this.node);
    const color = (c: string) =>
      c.startsWith('--') ? css.getPropertyValue(c).trim() || '#888' : c;
    const axisColor = color('--jp-ui-font-color2');
    const gridColor = color('--jp-border-color2');
    const axis: uPlot.Axis = {
      stroke: axisColor,
      grid: { stroke: gridColor, width: 1 },
      ticks: { stroke: gridColor, width: 1 }
    };
    const opts: uPlot.Options = {
      width: this._width(),
      height: this._opts.height ?? 140,
      legend: { show: true, live: false },
      cursor: { drag: { x: false, y: false } },
      scales: {
        x: { time: true },
        y: { range: (_u, _min, max) => this._opts.yRange(max ?? 0) }
      },
      axes: [
        { ...axis },
        {
          ...axis,
          size: 60,
          values: (_u, ticks) => ticks.map(v => `${v}${this._opts.series[0]?.unit ?? ''}`)
        }
      ],
      series: [
        {},
        ...this._opts.series.map(s => ({
          label: s.label,
          stroke: color(s.stroke),
          width: 1.5,
          dash: s.dash,
          points: { show: false },
          spanGaps: false,
          value: (_u: uPlot, v: number | null) =>
            v === null || v === undefined ? '–' : `${v.toFixed(s.digits)} ${s.unit}`.trim()
        }))
      ]
    };
    this._plot = new uPlot(opts, this._data, this._plotHost);
  }

  private _width(): number {
    return Math.max(200, Math.floor(this.node.clientWidth || 400) - 4);
  }

  private _fit(): void {
    if (!this._plot) {
      return;
    }
    const width = this._width();
    if (width !== this._plot.width) {
      this._plot.setSize({ width, height: this._opts.height ?? 140 });
    }
  }

  private _plot: uPlot | null = null;
  private _data: uPlot.AlignedData;
  private readonly _plotHost: HTMLDivElement;
  private readonly _resize: ResizeObserver;
  private readonly _theme: MutationObserver;
}
