{{/*
The Tandem deploy config (deploy/config.py) built from the values as a dict, then written with toYaml: no
hand-assembled YAML, so quoting and nesting are always valid. Keys are the config's snake_case names.
*/}}
{{- define "tandem.engineConfig" -}}
{{- $engine := dict -}}
{{- range $section, $fields := . -}}
{{- $out := dict -}}
{{- range $key, $value := $fields -}}
{{- $_ := set $out (snakecase $key) $value -}}
{{- end -}}
{{- $_ := set $engine $section $out -}}
{{- end -}}
{{- toJson $engine -}}
{{- end -}}

{{- define "tandem.poolConfig" -}}
{{- $pool := index .ctx.Values .role -}}
{{- $gpus := int $pool.gpusPerWorker -}}
{{- $perPod := int (include "tandem.workersPerPod" $pool) -}}
{{- $resource := include "tandem.roleResource" .role -}}
{{- /* num_gpus and ray_resources are per rank: a worker of tensorParallelSize ranks asks that many of each. */ -}}
{{- $config := dict "replicas" (mul (int $pool.replicas) $perPod) "num_gpus" (min $gpus 1) -}}
{{- $_ := set $config "ray_resources" (dict $resource 1) -}}
{{- /* Each of the pod's workers (its rank 0) takes the first free of its group's worker metrics ports. */ -}}
{{- $_ := set $config "metrics_port" (int .ctx.Values.workers.metricsPort) -}}
{{- $_ := set $config "metrics_port_count" $perPod -}}
{{- $engine := include "tandem.engineConfig" ($pool.engine | default dict) | fromJson -}}
{{- /* `parallel` holds tensorParallelSize and allReduce (values.schema.json). At a size of 1, the deploy config's
default, it is left out (allReduce means nothing on one device), so a one-device pool's config, and the checksum that rolls the routers and the controller, stay as
they were before the chart knew the key. */ -}}
{{- if eq (int (include "tandem.tensorParallelSize" $pool)) 1 -}}
{{- $_ := unset $engine "parallel" -}}
{{- end -}}
{{- $_ := set $config "engine" $engine -}}
{{- toJson $config -}}
{{- end -}}

{{/* The deploy config's `autoscaler` section (deploy/autoscaler/settings.py); pool bounds count workers. */}}
{{- define "tandem.autoscalerConfig" -}}
{{- $a := .Values.autoscaler -}}
{{- $out := dict "enabled" true "interval_s" $a.intervalSeconds "window_s" $a.windowSeconds -}}
{{- $_ := set $out "min_requests" (int $a.minRequests) -}}
{{- $_ := set $out "ttft_s" $a.ttftSeconds -}}
{{- $_ := set $out "tpot_s" $a.tpotSeconds -}}
{{- $_ := set $out "scale_up_patience" (int $a.scaleUpPatience) -}}
{{- $_ := set $out "scale_down_patience" (int $a.scaleDownPatience) -}}
{{- $_ := set $out "scale_down_margin" $a.scaleDownMargin -}}
{{- $_ := set $out "scale_down_utilization" $a.scaleDownUtilization -}}
{{- $_ := set $out "cooldown_s" $a.cooldownSeconds -}}
{{- $_ := set $out "shrink_memory_s" $a.shrinkMemorySeconds -}}
{{- $_ := set $out "max_total_workers" (int $a.maxTotalWorkers) -}}
{{- range $role := include "tandem.roles" . | fromJsonArray -}}
{{- $pool := index $.Values $role -}}
{{- $per := int (include "tandem.workersPerPod" $pool) -}}
{{- $min := mul (int (include "tandem.minPods" $pool)) $per -}}
{{- $_ := set $out $role (dict "min" $min "max" (mul (int (include "tandem.maxPods" $pool)) $per)) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* Where router pods mount router.apiKeys.secretName: a directory, not a subPath, so Secret updates arrive. */}}
{{- define "tandem.apiKeysDir" -}}/etc/tandem-keys{{- end -}}

{{/* Where the Ray head (the controller) mounts router.apiKeys.controllerKeySecretName: re-read on every push. */}}
{{- define "tandem.controllerKeyDir" -}}/etc/tandem-controller-key{{- end -}}

{{- define "tandem.config" -}}
{{- $v := .Values -}}
{{- $router := dict "host" "0.0.0.0" "port" (int $v.router.grpcPort) "metrics_port" (int $v.router.metricsPort) -}}
{{- $_ := set $router "http_port" (int $v.router.httpPort) -}}
{{- $_ := set $router "max_queue" (int $v.router.maxQueue) -}}
{{- $_ := set $router "max_inflight" (int $v.router.maxInflight) -}}
{{- $_ := set $router "request_timeout_s" $v.router.requestTimeoutSeconds -}}
{{- $_ := set $router "default_max_tokens" (int $v.router.defaultMaxTokens) -}}
{{- with $v.router.apiKeys -}}
{{- if .secretName -}}
{{- $auth := dict "api_keys_file" (printf "%s/%s" (include "tandem.apiKeysDir" $) .secretKey) -}}
{{- $_ := set $auth "reload_interval_s" .reloadIntervalSeconds -}}
{{- $_ := set $router "auth" $auth -}}
{{- end -}}
{{- end -}}
{{- $transfer := dict "transfer_timeout_s" $v.transfer.transferTimeoutSeconds -}}
{{- if $v.transfer.kinds -}}
{{- $_ := set $transfer "kinds" $v.transfer.kinds -}}
{{- else -}}
{{- $_ := set $transfer "kind" $v.transfer.kind -}}
{{- end -}}
{{- $_ := set $transfer "pair_setup_timeout_s" $v.transfer.pairSetupTimeoutSeconds -}}
{{- $_ := set $transfer "layer_groups" (int $v.transfer.layerGroups) -}}
{{- $_ := set $transfer "nccl_lanes" (int $v.transfer.ncclLanes) -}}
{{- $_ := set $transfer "doorbell_slots" (int $v.transfer.doorbellSlots) -}}
{{- $routers := list (printf "%s.%s.svc:%d" (include "tandem.routerHeadlessName" .) .Release.Namespace (int $v.router.grpcPort)) -}}
{{- $controller := dict "routers" $routers "restart_limit" (int $v.controller.restartLimit) -}}
{{- $_ := set $controller "health_interval_s" $v.controller.healthIntervalSeconds -}}
{{- $_ := set $controller "heartbeat_timeout_s" $v.controller.heartbeatTimeoutSeconds -}}
{{- $_ := set $controller "drain_timeout_s" $v.controller.drainTimeoutSeconds -}}
{{- with $v.router.apiKeys -}}
{{- if .controllerKeySecretName -}}
{{- $_ := set $controller "admin_key_file" (printf "%s/%s" (include "tandem.controllerKeyDir" $) .controllerKeySecretKey) -}}
{{- end -}}
{{- end -}}
{{- $config := dict "model" $v.model "mode" $v.mode "router" $router "transfer" $transfer -}}
{{- $_ := set $config "controller" $controller -}}
{{- if $v.autoscaler.enabled -}}
{{- $_ := set $config "autoscaler" (include "tandem.autoscalerConfig" . | fromJson) -}}
{{- end -}}
{{- $_ := set $config "ray" (dict "address" "auto" "namespace" "tandem") -}}
{{- $tls := include "tandem.tlsConfig" . | fromJson -}}
{{- if $tls -}}
{{- $_ := set $config "tls" $tls -}}
{{- end -}}
{{- range $role := include "tandem.roles" . | fromJsonArray -}}
{{- $_ := set $config $role (include "tandem.poolConfig" (dict "ctx" $ "role" $role) | fromJson) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}
