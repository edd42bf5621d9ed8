{{- /*
  Names and labels, after z2jh's conventions: every pod carries `app` (the chart's name, which
  GPUKubeSpawner also puts on user servers), `component`, `release`, `chart` and `heritage`;
  selectors use `app`, `component` and `release` only, since those never change on upgrade.
*/}}

{{- define "gpulab.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpulab.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "gpulab.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "gpulab.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- /* object names: <fullname>-<part> */}}
{{- define "gpulab.hub.fullname" -}}{{ include "gpulab.fullname" . }}-hub{{- end }}
{{- define "gpulab.proxy.fullname" -}}{{ include "gpulab.fullname" . }}-proxy{{- end }}
{{- define "gpulab.proxy-api.fullname" -}}{{ include "gpulab.fullname" . }}-proxy-api{{- end }}
{{- define "gpulab.proxy-public.fullname" -}}{{ include "gpulab.fullname" . }}-proxy-public{{- end }}
{{- define "gpulab.dask-operator.fullname" -}}{{ include "gpulab.fullname" . }}-dask-operator{{- end }}

{{- define "gpulab.chartLabel" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{- /* selector labels; call with (dict "root" $ "component" "hub") */}}
{{- define "gpulab.matchLabels" -}}
app: {{ include "gpulab.name" .root | quote }}
component: {{ .component | quote }}
release: {{ .root.Release.Name | quote }}
{{- end }}

{{- define "gpulab.labels" -}}
{{ include "gpulab.matchLabels" . }}
chart: {{ include "gpulab.chartLabel" .root | quote }}
heritage: {{ .root.Release.Service | quote }}
app.kubernetes.io/name: {{ include "gpulab.name" .root | quote }}
app.kubernetes.io/instance: {{ .root.Release.Name | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service | quote }}
{{- end }}

{{- define "gpulab.image" -}}
{{- printf "%s:%s" .name .tag }}
{{- end }}

{{- /* the non-root hardening of the chart's own pods (the servers' is GPUKubeSpawner's) */}}
{{- define "gpulab.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .runAsUser }}
runAsGroup: {{ .runAsGroup }}
fsGroup: {{ .fsGroup }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "gpulab.containerSecurityContext" -}}
allowPrivilegeEscalation: false
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{- /* requests/limits without the empty entries values.yaml uses for "none" */}}
{{- define "gpulab.resources" -}}
{{- range $kind := list "requests" "limits" }}
{{- $set := dict }}
{{- range $name, $value := (get $ $kind | default dict) }}
{{- if $value }}{{ $_ := set $set $name $value }}{{ end }}
{{- end }}
{{- if $set }}
{{ $kind }}:
  {{- toYaml $set | nindent 2 }}
{{- end }}
{{- end }}
{{- end }}

{{- /*
  A secret value that survives upgrades: the value given, else what the existing Secret holds
  (lookup answers nothing offline, in `helm template` and in tests), else a new random one.
  Call with (dict "root" $ "key" "cookie-secret" "value" .Values.hub.cookieSecret).
*/}}
{{- define "gpulab.secretValue" -}}
{{- if .value }}
{{- .value }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace (include "gpulab.hub.fullname" .root) }}
{{- if and $existing (index ($existing.data | default dict) .key) }}
{{- index $existing.data .key | b64dec }}
{{- else }}
{{- randAlphaNum 64 | sha256sum }}
{{- end }}
{{- end }}
{{- end }}

{{- /* the PriorityClass of a profile's tier */}}
{{- define "gpulab.priorityClassName" -}}
{{- if eq (.priority | default "on-demand") "preemptible" }}
{{- .root.Values.gpulab.priorityClasses.preemptible.name }}
{{- else }}
{{- .root.Values.gpulab.priorityClasses.onDemand.name }}
{{- end }}
{{- end }}
