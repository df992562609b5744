{{/* Names. Kubernetes names are DNS labels: 63 characters at most, so every name is cut and trimmed. */}}
{{- define "tandem.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* 40 characters for the prefix leave room for KubeRay's suffixes (<cluster>-head-svc, <group> pod names). */}}
{{- define "tandem.rayClusterName" -}}{{ include "tandem.fullname" . }}{{- end -}}
{{- define "tandem.configMapName" -}}{{ include "tandem.fullname" . }}-config{{- end -}}
{{- define "tandem.routerName" -}}{{ include "tandem.fullname" . }}-router{{- end -}}
{{- define "tandem.routerHeadlessName" -}}{{ include "tandem.fullname" . }}-router-headless{{- end -}}

{{- define "tandem.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "tandem.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
Labels. Call with (dict "ctx" $ "component" "router"). Selector labels are the stable subset (name, instance,
component); the full set adds the version and chart, which change on upgrade and so must stay out of selectors.
*/}}
{{- define "tandem.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tandem.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "tandem.labels" -}}
{{ include "tandem.selectorLabels" . }}
app.kubernetes.io/version: {{ default .ctx.Chart.AppVersion .ctx.Values.image.tag | trunc 63 | quote }}
app.kubernetes.io/part-of: tandem
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
helm.sh/chart: {{ include "tandem.chart" .ctx }}
{{- end -}}

{{/* The worker pools this mode runs, as a JSON list: the RayCluster's worker groups and the config's pools. */}}
{{- define "tandem.roles" -}}
{{- if eq .Values.mode "colocated" -}}
["colocated"]
{{- else -}}
["prefill", "decode"]
{{- end -}}
{{- end -}}

{{/* Ray custom resource that pins a role's workers to its worker group. */}}
{{- define "tandem.roleResource" -}}tandem_{{ . }}{{- end -}}

{{/*
Devices and workers per pod of a pool (call with the pool's values). A pod offers max(1, gpusPerWorker) devices
(one CPU device when the pool has no GPUs); a worker spans engine.parallel.tensorParallelSize of them, one rank
(one Ray placement group bundle) per device, all in one pod:

    gpusPerWorker 8, tensorParallelSize 2:  | worker 0: gpu 0 1 | worker 1: gpu 2 3 | worker 2: gpu 4 5 | ... 6 7 |

The config's pool replicas count workers and the group's custom resource counts devices (every rank asks one
unit), so the controller asks for exactly what the pods offer. tandem.validate makes the division exact.
*/}}
{{- define "tandem.tensorParallelSize" -}}{{ int (dig "engine" "parallel" "tensorParallelSize" 1 .) }}{{- end -}}
{{- define "tandem.devicesPerPod" -}}{{ max 1 (int .gpusPerWorker) }}{{- end -}}
{{- define "tandem.workersPerPod" -}}
{{- div (int (include "tandem.devicesPerPod" .)) (int (include "tandem.tensorParallelSize" .)) -}}
{{- end -}}

{{/*
A pool's range of pods: minReplicas..maxReplicas, each replicas when unset. The worker group ranges over it when
ray.autoscaling.enabled; the SLO autoscaler keeps the pool's workers within it (times workersPerPod).
*/}}
{{- define "tandem.minPods" -}}{{ int (default .replicas .minReplicas) }}{{- end -}}
{{- define "tandem.maxPods" -}}{{ int (default .replicas .maxReplicas) }}{{- end -}}

{{/*
Container port name of a pod's i-th Tandem worker's /metrics (port workers.metricsPort + i). Port names are at
most 15 characters and unique in a pod, hence one short name per index: w0-metrics .. w15-metrics.
*/}}
{{- define "tandem.workerMetricsPortName" -}}w{{ . }}-metrics{{- end -}}

{{/*
Volumes and mounts. Call with (dict "ctx" $ "config" true|false): the config is mounted where it is read (router,
Ray head: the controller runs there); the model volume, when set, everywhere the model is loaded.
*/}}
{{- define "tandem.volumes" -}}
{{- if .config }}
- name: tandem-config
  configMap:
    name: {{ include "tandem.configMapName" .ctx }}
{{- end }}
{{- if .ctx.Values.modelVolume.claimName }}
- name: models
  persistentVolumeClaim:
    claimName: {{ .ctx.Values.modelVolume.claimName }}
    readOnly: true
{{- end }}
{{- end -}}

{{- define "tandem.volumeMounts" -}}
{{- if .config }}
- name: tandem-config
  mountPath: /etc/tandem
  readOnly: true
{{- end }}
{{- if .ctx.Values.modelVolume.claimName }}
- name: models
  mountPath: {{ .ctx.Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/* Pods run as the image's unprivileged user (uid 1000, see deploy/Dockerfile). */}}
{{- define "tandem.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
{{- end -}}

{{- define "tandem.containerSecurityContext" -}}
allowPrivilegeEscalation: false
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* Always present (possibly []) so that templates need no conditional around it. */}}
{{- define "tandem.imagePullSecrets" -}}
imagePullSecrets: {{ toJson .Values.imagePullSecrets }}
{{- end -}}

{{/* Fail early on combinations the schema cannot express. */}}
{{- define "tandem.validate" -}}
{{- range $role := include "tandem.roles" . | fromJsonArray }}
{{- $pool := index $.Values $role }}
{{- if lt (int $pool.replicas) 1 }}
{{- fail (printf "%s.replicas: mode %s needs at least one %s pod" $role $.Values.mode $role) }}
{{- end }}
{{- include "tandem.validateParallel" (dict "role" $role "pool" $pool) }}
{{- $first := int $.Values.workers.metricsPort }}
{{- $last := add $first (int (include "tandem.workersPerPod" $pool)) -1 }}
{{- if or (and (le $first 8080) (ge $last 8080)) (and (le $first 19999) (ge $last 10002)) }}
{{- fail (printf "workers.metricsPort: the %s pods' worker metrics ports %d-%d overlap Ray's metrics port 8080 or its worker ports 10002-19999" $role $first $last) }}
{{- end }}
{{- $min := int (include "tandem.minPods" $pool) }}
{{- $max := int (include "tandem.maxPods" $pool) }}
{{- if or (gt $min (int $pool.replicas)) (lt $max (int $pool.replicas)) }}
{{- fail (printf "%s.minReplicas / %s.maxReplicas: must range around %s.replicas (%d), got %d..%d" $role $role $role (int $pool.replicas) $min $max) }}
{{- end }}
{{- if and (gt $max (int $pool.replicas)) (not (dig "autoscaling" "enabled" false $.Values.ray)) }}
{{- fail (printf "%s.maxReplicas: %d pods, above %s.replicas (%d), need ray.autoscaling.enabled: without it no pod would ever hold the workers past the running ones" $role $max $role (int $pool.replicas)) }}
{{- end }}
{{- if and (eq (int $pool.gpusPerWorker) 0) $.Values.transfer.kinds (not (has "tcp" $.Values.transfer.kinds)) }}
{{- fail (printf "transfer.kinds: %v has no tcp, but %s.gpusPerWorker is 0 and CPU pools move KV over tcp only; add tcp" $.Values.transfer.kinds $role) }}
{{- end }}
{{- if and (eq (int $pool.gpusPerWorker) 0) (not $.Values.transfer.kinds) (ne $.Values.transfer.kind "tcp") }}
{{- fail (printf "transfer.kind: %s needs GPUs, but %s.gpusPerWorker is 0; use tcp for CPU pools" $.Values.transfer.kind $role) }}
{{- end }}
{{- end }}
{{- if eq .Values.mode "disaggregated" }}
{{- $p := dig "engine" "cache" "blockSize" 16 .Values.prefill }}
{{- $d := dig "engine" "cache" "blockSize" 16 .Values.decode }}
{{- if ne (int $p) (int $d) }}
{{- fail (printf "decode.engine.cache.blockSize: must equal prefill.engine.cache.blockSize (%d), got %d" (int $p) (int $d)) }}
{{- end }}
{{- end }}
{{- include "tandem.validateTls" . }}
{{- if and .Values.router.apiKeys.secretName (not .Values.router.apiKeys.controllerKeySecretName) (not .Values.tls.clientCaSecretName) }}
{{- fail "router.apiKeys.controllerKeySecretName: with API keys on, the routers take the controller's membership pushes only with an admin key (a Secret holding one) or, with tls.clientCaSecretName, its cluster certificate" }}
{{- end }}
{{- end -}}

{{/*
A pool's workers spanning devices: on GPUs, whole workers per pod. Prefill and decode workers hand KV over rank by
rank (each rank its own KV heads), between the sizes deploy/config.py HANDOFF_TP_SIZES lists (test_helm_values.py
checks the two lists agree); colocated workers hand nothing over and take the schema's whole range.
*/}}
{{- define "tandem.validateParallel" -}}
{{- $tp := int (include "tandem.tensorParallelSize" .pool) }}
{{- $gpus := int .pool.gpusPerWorker }}
{{- if and (ne .role "colocated") (not (has $tp (list 1 2 4 8))) }}
{{- fail (printf "%s.engine.parallel.tensorParallelSize: %d, but a %s worker hands its KV over rank by rank only at 1, 2, 4 or 8 devices; use one of those" .role $tp .role) }}
{{- end }}
{{- if and (gt $tp 1) (eq $gpus 0) }}
{{- fail (printf "%s.engine.parallel.tensorParallelSize: %d needs GPUs (one per rank), but %s.gpusPerWorker is 0; use 1 on CPU pods" .role $tp .role) }}
{{- end }}
{{- if ne (mod $gpus $tp) 0 }}
{{- fail (printf "%s.gpusPerWorker: %d is not a multiple of %s.engine.parallel.tensorParallelSize (%d): a worker's ranks all run in one pod, so each pod must hold whole workers" .role $gpus .role $tp) }}
{{- end }}
{{- end -}}

{{- define "tandem.validateTls" -}}
{{- if and .Values.tls.clientCaSecretName (not (include "tandem.routerTlsSecret" .)) }}
{{- fail "tls.clientCaSecretName: client certificates need TLS on the routers; set tls.routerSecretName (or tls.certManager.enabled)" }}
{{- end }}
{{- if and (include "tandem.routerTlsSecret" .) (not (include "tandem.clusterTlsSecret" .)) }}
{{- fail "tls.routerSecretName: needs tls.internalSecretName (or tls.certManager.enabled): the controller and the health probes reach TLS routers with the cluster certificate" }}
{{- end }}
{{- if and .Values.tls.certManager.enabled (not .Values.tls.certManager.issuerName) }}
{{- fail "tls.certManager.issuerName: the Issuer or ClusterIssuer that signs the certificates, required with tls.certManager.enabled" }}
{{- end }}
{{- end -}}
