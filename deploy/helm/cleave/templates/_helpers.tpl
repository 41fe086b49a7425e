{{/* Names, labels, and the Cleave config the chart passes to the Serve application. */}}

{{- define "cleave.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cleave.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "cleave.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cleave.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "cleave.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "cleave.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "cleave.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The pools present in `cleave.pools`, in Cleave's order (prefill, decode, aggregated). */}}
{{- define "cleave.poolNames" -}}
{{- $names := list }}
{{- range $name := list "prefill" "decode" "aggregated" }}
{{- if kindIs "map" (index $.Values.cleave.pools $name) }}{{ $names = append $names $name }}{{ end }}
{{- end }}
{{- toJson $names }}
{{- end }}

{{/* Cleave's defaults of the config values the chart reads itself, for values left null (JSON).
They are `cluster.config.CleaveConfig`'s; tests/deploy/test_chart_defaults.py checks they agree. */}}
{{- define "cleave.defaults" -}}
{{- dict "http_port" 8000 "grpc_port" 50051 "replicas_min" 1 "replicas_max" 1 "tp" 1 "pp" 1 "ep" 1 "gpus_per_rank" 0 "cpus_per_rank" 1 "block_size" 16 | toJson }}
{{- end }}

{{/* The router's HTTP port (Serve's HTTP proxy). */}}
{{- define "cleave.httpPort" -}}
{{- (default dict .Values.cleave.router).http_port | default (include "cleave.defaults" . | fromJson).http_port | int }}
{{- end }}

{{/* The router's gRPC port (Serve's gRPC proxy). */}}
{{- define "cleave.grpcPort" -}}
{{- (default dict .Values.cleave.router).grpc_port | default (include "cleave.defaults" . | fromJson).grpc_port | int }}
{{- end }}

{{/* Ranks (= tp × pp) per replica of the pool given as (dict "pool" <settings>). */}}
{{- define "cleave.ranks" -}}
{{- $d := include "cleave.defaults" . | fromJson }}
{{- mul (int (default $d.tp .pool.tp)) (int (default $d.pp .pool.pp)) }}
{{- end }}

{{/* The Ray custom resource naming a pool; each of its pods offers one unit per rank. */}}
{{- define "cleave.poolResource" -}}
{{- printf "cleave_pool_%s" . }}
{{- end }}

{{/* The model folder the chart mounts, or "" when the model source is `none`. */}}
{{- define "cleave.modelPath" -}}
{{- $src := .Values.modelSource }}
{{- if ne $src.type "none" }}
{{- if $src.subPath }}{{ printf "%s/%s" (trimSuffix "/" $src.mountPath) (trimPrefix "/" $src.subPath) }}{{ else }}{{ $src.mountPath }}{{ end }}
{{- end }}
{{- end }}

{{/* The Serve application's args: `cleave` with the chart's fills (JSON). */}}
{{- define "cleave.args" -}}
{{- $args := deepCopy .Values.cleave }}
{{- $model := default dict $args.model }}
{{- $modelPath := include "cleave.modelPath" . }}
{{- if $modelPath }}{{ $_ := set $model "path" $modelPath }}{{ end }}
{{- $_ := set $args "model" $model }}
{{- $router := default dict $args.router }}
{{- $_ := set $router "host" "0.0.0.0" }}
{{- if include "cleave.apiKeysSecret" . }}{{ $_ := set $router "api_keys_env" "CLEAVE_API_KEYS" }}{{ end }}
{{- $_ := set $args "router" $router }}
{{- range $name := include "cleave.poolNames" . | fromJsonArray }}
{{- $pool := index $args.pools $name }}
{{- $resources := default dict $pool.resources }}
{{- $key := include "cleave.poolResource" $name }}
{{- if not (hasKey $resources $key) }}{{ $_ := set $resources $key 1 }}{{ end }}
{{- $_ := set $pool "resources" $resources }}
{{- end }}
{{- range $name := list "prefill" "decode" "aggregated" }}
{{- if and (hasKey $args.pools $name) (not (kindIs "map" (index $args.pools $name))) }}{{ $_ := unset $args.pools $name }}{{ end }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/* The Ray Serve config (serveConfigV2), as `cluster.serve_config.build_serve_config` builds it. */}}
{{- define "cleave.serveConfig" -}}
{{- $args := include "cleave.args" . | fromJson }}
{{- $router := $args.router }}
{{- $http := dict "host" "0.0.0.0" "port" (include "cleave.httpPort" . | int) }}
{{- $grpc := dict "port" (include "cleave.grpcPort" . | int) "grpc_servicer_functions" (list "router.proto.cleave.v1.generate_pb2_grpc.add_GenerationServicer_to_server") }}
{{- $app := dict "name" "cleave" "route_prefix" "/" "import_path" "cluster.app:build_app" "args" $args }}
{{- $proxies := ternary "EveryNode" "Disabled" (eq (toString $router.ingress) "serve") }}
{{- dict "proxy_location" $proxies "http_options" $http "grpc_options" $grpc "applications" (list $app) | toYaml }}
{{- end }}

{{/* Environment every Ray pod gets: NCCL/UCX settings and the API keys. */}}
{{- define "cleave.commonEnv" -}}
{{- $net := .Values.network }}
{{- $vars := dict }}
{{- if $net.ncclSocketIfname }}{{ $_ := set $vars "NCCL_SOCKET_IFNAME" $net.ncclSocketIfname }}{{ end }}
{{- if $net.ncclIbHca }}{{ $_ := set $vars "NCCL_IB_HCA" $net.ncclIbHca }}{{ end }}
{{- if $net.ucxTls }}{{ $_ := set $vars "UCX_TLS" $net.ucxTls }}{{ end }}
{{- if $net.ucxNetDevices }}{{ $_ := set $vars "UCX_NET_DEVICES" $net.ucxNetDevices }}{{ end }}
{{- with .Values.monitoring.tracing }}{{ if .otlpEndpoint }}
{{- $_ := set $vars "OTEL_EXPORTER_OTLP_ENDPOINT" .otlpEndpoint }}
{{- $_ := set $vars "OTEL_SERVICE_NAME" .serviceName }}
{{- end }}{{ end }}
{{- range $k, $v := $net.extraEnv }}{{ $_ := set $vars $k $v }}{{ end }}
{{- range $k := keys $vars | sortAlpha }}
- name: {{ $k }}
  value: {{ index $vars $k | quote }}
{{- end }}
{{- with include "cleave.apiKeysSecret" . }}
- name: CLEAVE_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.apiKeys.secretKey }}
{{- end }}
{{- end }}

{{/* The Secret the API keys come from: the existing one, the generated one, or "" (none). */}}
{{- define "cleave.apiKeysSecret" -}}
{{- if .Values.apiKeys.existingSecret }}{{ .Values.apiKeys.existingSecret }}
{{- else if .Values.apiKeys.generate }}{{ include "cleave.fullname" . }}-api-keys
{{- end }}
{{- end }}
