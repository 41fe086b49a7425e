{{/* Pieces of the Ray pod templates: the model volume, /dev/shm, the download init container,
and the worker group one pool renders (`cleave.workerGroup`). */}}

{{- define "cleave.volumes" -}}
{{- $src := .root.Values.modelSource }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
{{- if eq $src.type "pvc" }}
- name: model
  persistentVolumeClaim:
    claimName: {{ $src.pvc.claimName }}
    readOnly: true
{{- else if eq $src.type "hostPath" }}
- name: model
  hostPath:
    path: {{ $src.hostPath.path }}
    type: Directory
{{- else if eq $src.type "download" }}
- name: model
  emptyDir:
    sizeLimit: {{ $src.download.sizeLimit }}
{{- end }}
{{- end }}

{{- define "cleave.volumeMounts" -}}
- name: dshm
  mountPath: /dev/shm
{{- if ne .Values.modelSource.type "none" }}
- name: model
  mountPath: {{ .Values.modelSource.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{/* Downloads the model into the pod's model volume before Ray starts. */}}
{{- define "cleave.initContainers" -}}
{{- $src := .Values.modelSource }}
{{- if eq $src.type "download" }}
initContainers:
  - name: download-model
    image: {{ include "cleave.image" . }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command:
      - python
      - -c
      - >-
        import os; from huggingface_hub import snapshot_download;
        snapshot_download(repo_id=os.environ["CLEAVE_REPO_ID"],
        revision=os.environ["CLEAVE_REVISION"], local_dir=os.environ["CLEAVE_MODEL_DIR"])
    env:
      - {name: CLEAVE_REPO_ID, value: {{ $src.download.repoId | quote }}}
      - {name: CLEAVE_REVISION, value: {{ $src.download.revision | quote }}}
      - {name: CLEAVE_MODEL_DIR, value: {{ include "cleave.modelPath" . | quote }}}
      {{- if $src.download.secretName }}
      - name: HF_TOKEN
        valueFrom:
          secretKeyRef: {name: {{ $src.download.secretName }}, key: {{ $src.download.secretKey }}}
      {{- end }}
    volumeMounts:
      - name: model
        mountPath: {{ $src.mountPath }}
{{- end }}
{{- end }}

{{/* The pool's worker pod settings: `workerDefaults` with `workers.<pool>` over it, key by key. */}}
{{- define "cleave.workerSettings" -}}
{{- $settings := deepCopy .root.Values.workerDefaults }}
{{- range $k, $v := (index (default dict .root.Values.workers) .name | default dict) }}
{{- $_ := set $settings $k $v }}
{{- end }}
{{- toJson $settings }}
{{- end }}

{{/* One Ray worker group: (dict "root" $ "name" <pool name>). */}}
{{- define "cleave.workerGroup" -}}
{{- $root := .root }}
{{- $name := .name }}
{{- $pool := index $root.Values.cleave.pools $name }}
{{- $s := include "cleave.workerSettings" . | fromJson }}
{{- $d := include "cleave.defaults" . | fromJson }}
{{- $ranks := include "cleave.ranks" (dict "pool" $pool) | int }}
{{- $gpus := mulf $ranks (ternary $d.gpus_per_rank $pool.gpus_per_rank (kindIs "invalid" $pool.gpus_per_rank)) }}
{{- $replicas := default dict $pool.replicas }}
{{- $min := ternary $d.replicas_min $replicas.min (kindIs "invalid" $replicas.min) | int }}
{{- $max := ternary $d.replicas_max $replicas.max (kindIs "invalid" $replicas.max) | int }}
{{- $initial := ternary $min $replicas.initial (kindIs "invalid" $replicas.initial) | int }}
{{- $rayStart := dict "metrics-export-port" (toString $root.Values.monitoring.rayMetricsPort) "resources" (printf "\"{\\\"%s\\\": %d}\"" (include "cleave.poolResource" $name) $ranks) }}
{{- range $k, $v := $s.rayStartParams }}{{ $_ := set $rayStart $k (toString $v) }}{{ end }}
- groupName: {{ $name }}
  replicas: {{ $initial }}
  minReplicas: {{ $min }}
  maxReplicas: {{ $max }}
  idleTimeoutSeconds: {{ $s.idleTimeoutSeconds }}
  rayStartParams:
    {{- toYaml $rayStart | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "cleave.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: worker
        cleave.io/pool: {{ $name }}
        {{- with $s.labels }}{{ toYaml . | nindent 8 }}{{ end }}
      {{- with $s.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $s.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $s.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with include "cleave.initContainers" $root | trim }}{{ . | nindent 6 }}{{ end }}
      containers:
        - name: ray-worker
          image: {{ include "cleave.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- $limits := dict "cpu" (printf "%v" (mulf $ranks $s.cpuPerRank)) "memory" (printf "%vGi" (mulf $ranks $s.memoryPerRankGi)) }}
          {{- if gt $gpus 0.0 }}{{ $_ := set $limits "nvidia.com/gpu" (printf "%d" (int $gpus)) }}{{ end }}
          {{- range $k, $v := $s.extraResources }}{{ $_ := set $limits $k (toString $v) }}{{ end }}
          resources:
            limits:
              {{- toYaml $limits | nindent 14 }}
            requests:
              {{- toYaml $limits | nindent 14 }}
          {{- $env := include "cleave.commonEnv" $root | trim }}
          {{- if or $env $s.env }}
          env:
            {{- with $env | trim }}{{ . | nindent 12 }}{{ end }}
            {{- with $s.env }}{{ toYaml . | nindent 12 }}{{ end }}
          {{- end }}
          ports:
            - {name: serve, containerPort: {{ include "cleave.httpPort" $root }}}
            - {name: grpc, containerPort: {{ include "cleave.grpcPort" $root }}}
            - {name: ray-metrics, containerPort: {{ $root.Values.monitoring.rayMetricsPort }}}
          volumeMounts:
            {{- include "cleave.volumeMounts" $root | trim | nindent 12 }}
      volumes:
        {{- include "cleave.volumes" (dict "root" $root "shmSize" $s.shmSize) | trim | nindent 8 }}
{{- end }}
