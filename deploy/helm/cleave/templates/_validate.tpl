{{/* Cross-field rules of Cleave's config (cluster/config.py) and of the chart, checked at render
time; each message names the value, in the words of Cleave's own errors. Types, ranges and
unknown keys are values.schema.json's job. */}}
{{- define "cleave.validate" -}}
{{- $pools := .Values.cleave.pools }}
{{- $names := include "cleave.poolNames" . | fromJsonArray }}
{{- if and (has "aggregated" $names) (or (has "prefill" $names) (has "decode" $names)) }}
{{- fail "cleave.pools: give either an aggregated pool or prefill/decode pools, not both (set the others to null, e.g. --set cleave.pools.prefill=null)" }}
{{- end }}
{{- if not (or (has "decode" $names) (has "aggregated" $names)) }}
{{- fail "cleave.pools: a deployment needs a decode pool (with or without a prefill pool) or an aggregated pool" }}
{{- end }}
{{- $blockSizes := list }}
{{- $d := include "cleave.defaults" . | fromJson }}
{{- range $name := $names }}
{{- $pool := index $pools $name }}
{{- $where := printf "cleave.pools.%s" $name }}
{{- $r := default dict $pool.replicas }}
{{- $min := ternary $d.replicas_min $r.min (kindIs "invalid" $r.min) | int }}
{{- $max := ternary $d.replicas_max $r.max (kindIs "invalid" $r.max) | int }}
{{- if gt $min $max }}{{ fail (printf "%s.replicas: min=%d is more than max=%d" $where $min $max) }}{{ end }}
{{- if not (kindIs "invalid" $r.initial) }}
{{- if or (lt (int $r.initial) $min) (gt (int $r.initial) $max) }}{{ fail (printf "%s.replicas: initial=%d is outside [min=%d, max=%d]" $where (int $r.initial) $min $max) }}{{ end }}
{{- end }}
{{- $tp := default $d.tp $pool.tp | int }}
{{- $ep := default $d.ep $pool.ep | int }}
{{- if and (gt $ep 1) (ne $ep $tp) }}{{ fail (printf "%s: ep=%d must be 1 or equal to tp=%d (experts are sharded across the tensor-parallel group)" $where $ep $tp) }}{{ end }}
{{- $ranks := include "cleave.ranks" (dict "pool" $pool) | int }}
{{- $gpr := ternary $d.gpus_per_rank $pool.gpus_per_rank (kindIs "invalid" $pool.gpus_per_rank) }}
{{- $gpus := mulf $ranks $gpr }}
{{- if ne (floor $gpus) $gpus }}{{ fail (printf "%s: tp × pp × gpus_per_rank = %d × %v = %v GPUs per pod; it must be a whole number" $where $ranks $gpr $gpus) }}{{ end }}
{{- if and (gt $ranks 1) (gt (float64 $gpr) 0.0) (ne (floor $gpr) (float64 $gpr)) }}{{ fail (printf "%s: gpus_per_rank=%v with tp × pp = %d ranks: NCCL needs each rank on GPUs of its own; use a whole number" $where $gpr $ranks) }}{{ end }}
{{- $pp := default $d.pp $pool.pp | int }}
{{- if and (ne $name "aggregated") (gt $pp 1) (gt (float64 $gpr) 0.0) }}{{ fail (printf "%s: a GPU pool of pp = %d pipeline stages keeps each stage's layers of the KV cache on its ranks' GPUs and cannot hand it off yet; use an aggregated pool, or pp = 1 for prefill/decode pools (tp > 1 hands off from every rank)" $where $pp) }}{{ end }}
{{- $s := include "cleave.workerSettings" (dict "root" $ "name" $name) | fromJson }}
{{- $cpr := ternary $d.cpus_per_rank $pool.cpus_per_rank (kindIs "invalid" $pool.cpus_per_rank) }}
{{- if gt (float64 $cpr) (float64 $s.cpuPerRank) }}{{ fail (printf "%s.cpus_per_rank=%v is more than workers.%s.cpuPerRank=%v, the CPUs its pod has per rank" $where $cpr $name $s.cpuPerRank) }}{{ end }}
{{- if $pool.memory_per_rank_bytes }}
{{- if gt (float64 $pool.memory_per_rank_bytes) (mulf $s.memoryPerRankGi 1073741824) }}{{ fail (printf "%s.memory_per_rank_bytes=%v is more than workers.%s.memoryPerRankGi=%v GiB, the memory its pod has per rank" $where $pool.memory_per_rank_bytes $name $s.memoryPerRankGi) }}{{ end }}
{{- end }}
{{- $blockSizes = append $blockSizes ((default dict $pool.engine).block_size | default $d.block_size | int) }}
{{- end }}
{{- if gt (len (uniq $blockSizes)) 1 }}{{ fail (printf "cleave.pools: every pool must use the same engine.block_size, got %v" (uniq $blockSizes | sortAlpha)) }}{{ end }}
{{- $router := .Values.cleave.router }}
{{- $http := include "cleave.httpPort" . | int }}
{{- if eq $http (include "cleave.grpcPort" . | int) }}{{ fail (printf "cleave.router: http_port and grpc_port are both %d" $http) }}{{ end }}
{{- range $key := $router.api_keys | default list }}{{ if not $key }}{{ fail "cleave.router.api_keys must not contain empty strings" }}{{ end }}{{ end }}
{{- if not (or (include "cleave.apiKeysSecret" .) $router.api_keys $router.allow_unauthenticated) }}{{ fail "cleave.router: the router listens on 0.0.0.0 in the cluster and no API key is set; set apiKeys.existingSecret, keep apiKeys.generate, set cleave.router.api_keys, or set cleave.router.allow_unauthenticated=true to serve without keys" }}{{ end }}
{{- $weights := $router.policy_weights | default dict }}
{{- range $key := keys $weights | sortAlpha }}
{{- if not (has $key (list "w_hit" "w_queue" "w_kv" "queue_scale")) }}{{ fail (printf "cleave.router.policy_weights: unknown weight %q; expected some of [queue_scale w_hit w_kv w_queue]" $key) }}{{ end }}
{{- end }}
{{- if and $weights (ne (default "prefix_aware" $router.policy) "prefix_aware") }}{{ fail (printf "cleave.router.policy_weights apply to prefix_aware, not %q" $router.policy) }}{{ end }}
{{- $src := .Values.modelSource }}
{{- if and (ne $src.type "none") (.Values.cleave.model | default dict).path }}{{ fail (printf "cleave.model.path=%q and modelSource.type=%s both say where the model is; leave cleave.model.path null (the chart sets it to the mount)" .Values.cleave.model.path $src.type) }}{{ end }}
{{- if and (eq $src.type "pvc") (not $src.pvc.claimName) }}{{ fail "modelSource.pvc.claimName is required when modelSource.type=pvc" }}{{ end }}
{{- if and (eq $src.type "hostPath") (not $src.hostPath.path) }}{{ fail "modelSource.hostPath.path is required when modelSource.type=hostPath" }}{{ end }}
{{- if and (eq $src.type "download") (not $src.download.repoId) }}{{ fail "modelSource.download.repoId is required when modelSource.type=download" }}{{ end }}
{{- range $name, $_ := .Values.workers }}
{{- if not (has $name $names) }}{{ fail (printf "workers.%s configures a pool that cleave.pools does not have (pools: %s)" $name (join ", " $names)) }}{{ end }}
{{- end }}
{{- end }}
