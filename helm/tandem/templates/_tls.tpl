{{/*
TLS (values.tls; the deploy config's `tls` section, deploy/tls.py). Secrets are mounted as directories:
    /etc/tandem-tls/router     tls.crt, tls.key     routers (and the Ray head, which checks every file the config names)
    /etc/tandem-tls/client-ca  ca.crt               routers, Ray head
    /etc/tandem-tls/cluster    tls.crt, tls.key, ca.crt   routers, Ray head, Ray workers, the helm test Pod
*/}}
{{- define "tandem.tlsDir" -}}/etc/tandem-tls{{- end -}}

{{- define "tandem.routerTlsSecret" -}}
{{- if .Values.tls.routerSecretName -}}{{ .Values.tls.routerSecretName }}
{{- else if .Values.tls.certManager.enabled -}}{{ include "tandem.fullname" . }}-router-tls
{{- end -}}
{{- end -}}

{{- define "tandem.clusterTlsSecret" -}}
{{- if .Values.tls.internalSecretName -}}{{ .Values.tls.internalSecretName }}
{{- else if .Values.tls.certManager.enabled -}}{{ include "tandem.fullname" . }}-cluster-tls
{{- end -}}
{{- end -}}

{{/* The deploy config's tls section as JSON ({} when TLS is off). */}}
{{- define "tandem.tlsConfig" -}}
{{- $dir := include "tandem.tlsDir" . -}}
{{- $tls := dict -}}
{{- if include "tandem.routerTlsSecret" . -}}
{{- $router := dict "cert" (printf "%s/router/tls.crt" $dir) "key" (printf "%s/router/tls.key" $dir) -}}
{{- if .Values.tls.clientCaSecretName -}}
{{- $_ := set $router "client_ca" (printf "%s/client-ca/ca.crt" $dir) -}}
{{- $_ := set $router "require_client_cert" true -}}
{{- end -}}
{{- $_ := set $tls "router" $router -}}
{{- end -}}
{{- if include "tandem.clusterTlsSecret" . -}}
{{- $cluster := dict "ca" (printf "%s/cluster/ca.crt" $dir) "cert" (printf "%s/cluster/tls.crt" $dir) -}}
{{- $_ := set $cluster "key" (printf "%s/cluster/tls.key" $dir) -}}
{{- $_ := set $cluster "server_name" .Values.tls.workerServerName -}}
{{- $_ := set $tls "cluster" $cluster -}}
{{- end -}}
{{- toJson $tls -}}
{{- end -}}

{{/* Volumes for (dict "ctx" $ "router" true|false): the router Secrets only where router is true. */}}
{{- define "tandem.tlsVolumes" -}}
{{- $ctx := .ctx -}}
{{- if and .router (include "tandem.routerTlsSecret" $ctx) }}
- name: tls-router
  secret:
    secretName: {{ include "tandem.routerTlsSecret" $ctx }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
{{- end }}
{{- if and .router $ctx.Values.tls.clientCaSecretName }}
- name: tls-client-ca
  secret:
    secretName: {{ $ctx.Values.tls.clientCaSecretName }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- if include "tandem.clusterTlsSecret" $ctx }}
- name: tls-cluster
  secret:
    secretName: {{ include "tandem.clusterTlsSecret" $ctx }}
    defaultMode: 0440
    items:
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      - {key: ca.crt, path: ca.crt}
{{- end }}
{{- end -}}

{{- define "tandem.tlsMounts" -}}
{{- $ctx := .ctx -}}
{{- $dir := include "tandem.tlsDir" $ctx -}}
{{- if and .router (include "tandem.routerTlsSecret" $ctx) }}
- name: tls-router
  mountPath: {{ $dir }}/router
  readOnly: true
{{- end }}
{{- if and .router $ctx.Values.tls.clientCaSecretName }}
- name: tls-client-ca
  mountPath: {{ $dir }}/client-ca
  readOnly: true
{{- end }}
{{- if include "tandem.clusterTlsSecret" $ctx }}
- name: tls-cluster
  mountPath: {{ $dir }}/cluster
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The health check (files/health_check.py) as a command, for (dict "ctx" $ "target" "host:port"): over TLS with the
cluster certificate when the routers serve TLS, checking the router's certificate for the router Service's name.
*/}}
{{- define "tandem.healthCommand" -}}
{{- $ctx := .ctx -}}
{{- $dir := include "tandem.tlsDir" $ctx -}}
{{- $cmd := list "env" (printf "TANDEM_ROUTER=%s" .target) (printf "TANDEM_HEALTH_TIMEOUT=%d" (int (default 10 .timeout))) -}}
{{- if include "tandem.routerTlsSecret" $ctx -}}
{{- $cmd = concat $cmd (list (printf "TANDEM_TLS_CA=%s/cluster/ca.crt" $dir) (printf "TANDEM_TLS_CERT=%s/cluster/tls.crt" $dir)) -}}
{{- $cmd = concat $cmd (list (printf "TANDEM_TLS_KEY=%s/cluster/tls.key" $dir) (printf "TANDEM_TLS_SERVER_NAME=%s" (include "tandem.routerName" $ctx))) -}}
{{- end -}}
{{- $cmd = concat $cmd (list "python" "-c" ($ctx.Files.Get "files/health_check.py")) -}}
{{- toJson $cmd -}}
{{- end -}}
