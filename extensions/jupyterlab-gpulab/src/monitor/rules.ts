/** The rules section: the rules in force, a box to write one, and where the server refused it. */
import { Widget } from '@lumino/widgets';
import { RuleError } from './api';
import { MonitorModel } from './model';

const EXAMPLE = 'IF gpu_utilization > 80% FOR 30s THEN alert("HIGH_LOAD")';

export class RulesSection extends Widget {
  constructor(private readonly _model: MonitorModel) {
    super();
    this.addClass('gpulab-section');
    this.addClass('gpulab-rules');
    this.node.dataset.testid = 'gpulab-rules';

    const heading = document.createElement('h3');
    heading.textContent = 'Alert rules';
    this._notice = document.createElement('div');
    this._notice.className = 'gpulab-message gpulab-message-error';
    this._notice.dataset.testid = 'gpulab-rules-error';
    this._notice.hidden = true;
    this._list = document.createElement('ul');
    this._list.className = 'gpulab-rule-list';

    this._input = document.createElement('textarea');
    this._input.className = 'gpulab-rule-input jp-mod-styled';
    this._input.dataset.testid = 'gpulab-rule-input';
    this._input.rows = 3;
    this._input.spellcheck = false;
    this._input.placeholder = EXAMPLE;
    this._input.setAttribute('aria-label', 'New alert rule');
    this._input.addEventListener('keydown', event => {
      if (event.key === 'Enter' && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        void this._add();
      }
    });
    this._input.addEventListener('input', () => this._showError(null));

    this._button = document.createElement('button');
    this._button.className = 'jp-Button jp-mod-styled jp-mod-accept gpulab-rule-add';
    this._button.dataset.testid = 'gpulab-rule-add';
    this._button.textContent = 'Add rule';
    this._button.addEventListener('click', () => void this._add());

    this._error = document.createElement('div');
    this._error.className = 'gpulab-rule-error';
    this._error.dataset.testid = 'gpulab-rule-error';
    this._error.setAttribute('role', 'alert');
    this._error.hidden = true;

    const form = document.createElement('div');
    form.className = 'gpulab-rule-form';
    form.append(this._input, this._error, this._button);
    this.node.append(heading, this._notice, this._list, form);

    _model.changed.connect((_, what) => {
      if (what === 'rules') {
        this._render();
      }
    }, this);
    this._render();
  }

  private async _add(): Promise<void> {
    const text = this._input.value.trim();
    if (!text) {
      this._showError(new RuleError(`write a rule, e.g. ${EXAMPLE}`, null, null));
      return;
    }
    this._button.disabled = true;
    try {
      await this._model.addRule(text);
      this._input.value = '';
      this._showError(null);
    } catch (error) {
      this._showError(
        error instanceof RuleError
          ? error
          : new RuleError(String((error as Error).message ?? error), null, null),
        text
      );
    } finally {
      this._button.disabled = false;
    }
  }

  /** The message, with the offending line and a caret under the column when the server gave them. */
  private _showError(error: RuleError | null, text = ''): void {
    this._error.replaceChildren();
    this._error.hidden = error === null;
    this._input.classList.toggle('gpulab-mod-invalid', error !== null);
    if (!error) {
      return;
    }
    const where =
      error.line !== null
        ? `line ${error.line}${error.column !== null ? `, column ${error.column}` : ''}: `
        : '';
    const message = document.createElement('div');
    message.className = 'gpulab-rule-error-message';
    message.textContent = where + error.message;
    this._error.append(message);
    this._error.dataset.line = String(error.line ?? '');
    this._error.dataset.column = String(error.column ?? '');
    const line = error.line !== null ? text.split('\n')[error.line - 1] : undefined;
    if (line !== undefined) {
      const pre = document.createElement('pre');
      pre.className = 'gpulab-rule-error-context';
      const caret =
        error.column !== null ? '\n' + ' '.repeat(Math.max(0, error.column - 1)) + '^' : '';
      pre.textContent = line + caret;
      this._error.append(pre);
    }
  }

  private _render(): void {
    this._notice.textContent = this._model.rulesError;
    this._notice.hidden = !this._model.rulesError;
    this._list.replaceChildren();
    const rules = this._model.rules;
    if (!rules.length) {
      const empty = document.createElement('li');
      empty.className = 'gpulab-empty';
      empty.textContent = 'No rules yet.';
      this._list.append(empty);
    }
    for (const rule of rules) {
      const item = document.createElement('li');
      item.className = `gpulab-rule gpulab-severity-${rule.severity}`;
      item.dataset.testid = 'gpulab-rule';
      item.dataset.ruleId = rule.id;
      item.dataset.ruleName = rule.name;
      const badge = document.createElement('span');
      badge.className = 'gpulab-badge';
      badge.textContent = rule.source === 'default' ? `${rule.severity} · default` : rule.severity;
      const code = document.createElement('code');
      code.textContent = rule.text;
      item.append(badge, code);
      if (rule.source === 'user') {
        const remove = document.createElement('button');
        remove.className = 'jp-Button jp-mod-styled jp-mod-minimal gpulab-rule-delete';
        remove.dataset.testid = 'gpulab-rule-delete';
        remove.title = `Delete rule ${rule.name}`;
        remove.textContent = 'Delete';
        remove.addEventListener('click', async () => {
          remove.disabled = true;
          try {
            await this._model.deleteRule(rule.id);
          } catch (error) {
            remove.disabled = false;
            this._showError(
              new RuleError(
                `could not delete ${rule.name}: ${(error as Error).message}`,
                null,
                null
              )
            );
          }
        });
        item.append(remove);
      }
      this._list.append(item);
    }
  }

  private readonly _notice: HTMLDivElement;
  private readonly _list: HTMLUListElement;
  private readonly _input: HTMLTextAreaElement;
  private readonly _button: HTMLButtonElement;
  private readonly _error: HTMLDivElement;
}
