{{/*
Names, labels and the pieces the three roles' pods share.

Helpers that concern one role take a dict: (dict "root" $ "component" "drafter").
*/}}

{{- define "specd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* <release>-<chart>, or the release name alone when it already contains the chart name. The
longest suffix added to it is "-verifier-headless" (18 characters), so it stays under 45. */}}
{{- define "specd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 45 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 45 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "specd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "specd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "specd.labels" -}}
helm.sh/chart: {{ include "specd.chart" . }}
{{ include "specd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: specd
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component (drafter, verifier, trainer, redis). */}}
{{- define "specd.componentSelectorLabels" -}}
{{ include "specd.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specd.componentLabels" -}}
{{ include "specd.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "specd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "specd.secretName" -}}
{{- include "specd.fullname" . }}
{{- end }}

{{/* The Secret and key holding the bearer token. */}}
{{- define "specd.authSecretName" -}}
{{- default (include "specd.secretName" .) .Values.auth.existingSecret }}
{{- end }}

{{- define "specd.authSecretKey" -}}
{{- if .Values.auth.existingSecret }}{{ .Values.auth.existingSecretKey }}{{ else }}auth-token{{ end }}
{{- end }}

{{/* Whether any Redis is configured, and whether it is the in-chart one. */}}
{{- define "specd.redisExternal" -}}
{{- if or .Values.redis.external.url .Values.redis.external.existingSecret }}true{{ end }}
{{- end }}

{{- define "specd.redisInternal" -}}
{{- if and (not (include "specd.redisExternal" .)) .Values.redis.internal.enabled }}true{{ end }}
{{- end }}

{{- define "specd.redisConfigured" -}}
{{- if or (include "specd.redisExternal" .) (include "specd.redisInternal" .) }}true{{ end }}
{{- end }}

{{- define "specd.trainerEnabled" -}}
{{- if .Values.trainer.enabled }}true{{ end }}
{{- end }}

{{/* The role's image reference; empty role fields fall back to .Values.image. */}}
{{- define "specd.image" -}}
{{- $role := index .root.Values .component }}
{{- $repository := default .root.Values.image.repository $role.image.repository }}
{{- $tag := default .root.Values.image.tag $role.image.tag }}
{{- printf "%s:%s" $repository $tag }}
{{- end }}

{{- define "specd.imagePullPolicy" -}}
{{- $role := index .root.Values .component }}
{{- default .root.Values.image.pullPolicy $role.image.pullPolicy }}
{{- end }}

{{/*
One value as an environment variable's text, the way services/common/config.py parses it:
booleans true/false, lists comma-separated, and whole numbers without an exponent (Helm reads
every YAML number as a float64, which would print 1000000 as 1e+06).
*/}}
{{- define "specd.envText" -}}
{{- $value := . }}
{{- if kindIs "slice" $value }}
{{- $parts := list }}
{{- range $value }}{{ $parts = append $parts (include "specd.envText" .) }}{{ end }}
{{- join "," $parts }}
{{- else if and (kindIs "float64" $value) (eq $value (floor $value)) }}
{{- int64 $value }}
{{- else }}
{{- toString $value }}
{{- end }}
{{- end }}

{{/* The role's effective SPECD_* settings: the shared config overridden by the role's config. */}}
{{- define "specd.roleConfig" -}}
{{- $role := index .root.Values .component }}
{{- toJson (merge (deepCopy (default dict $role.config)) (deepCopy (default dict .root.Values.config))) }}
{{- end }}

{{/* Refuses a grace period that does not outlast the drain: two phases of up to drain_seconds
each (the verifier finishes running requests, then gRPC lets in-flight calls end). */}}
{{- define "specd.checkGrace" -}}
{{- $role := index .root.Values .component }}
{{- $config := include "specd.roleConfig" . | fromJson }}
{{- $drain := 10.0 }}
{{- if hasKey $config "drain_seconds" }}{{ $drain = float64 $config.drain_seconds }}{{ end }}
{{- if le (float64 $role.terminationGracePeriodSeconds) (mulf 2.0 $drain) }}
{{- fail (printf "%s.terminationGracePeriodSeconds (%v) must be larger than twice drain_seconds (%v): on SIGTERM the service finishes running requests, then in-flight calls, each for up to drain_seconds, and Kubernetes kills it when the grace period ends; raise %s.terminationGracePeriodSeconds or lower drain_seconds" .component $role.terminationGracePeriodSeconds $drain .component) }}
{{- end }}
{{- end }}

{{/* Checks of one role's autoscaler values that the schema cannot express. */}}
{{- define "specd.checkAutoscaling" -}}
{{- $autoscaling := (index .root.Values .component).autoscaling }}
{{- if and $autoscaling.enabled (lt (int $autoscaling.maxReplicas) (int $autoscaling.minReplicas)) }}
{{- fail (printf "%s.autoscaling.maxReplicas (%v) is below minReplicas (%v): raise maxReplicas" .component $autoscaling.maxReplicas $autoscaling.minReplicas) }}
{{- end }}
{{- end }}

{{/* Pod-level security: non-root, RuntimeDefault seccomp. */}}
{{- define "specd.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
fsGroup: {{ .Values.securityContext.fsGroup }}
fsGroupChangePolicy: OnRootMismatch
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Container-level security: read-only root, no privilege escalation, no capabilities. */}}
{{- define "specd.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
privileged: false
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* Environment every specd container gets: writable caches under /tmp (the root filesystem is
read-only), the bearer token from the Secret, the Redis URL when the role uses Redis
(withRedis), distributed.env in a multi-process pod, then the role's own `env`. */}}
{{- define "specd.env" -}}
{{- $root := .root -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /tmp/.cache
- name: TRITON_CACHE_DIR
  value: /tmp/.triton
- name: MPLCONFIGDIR
  value: /tmp/.matplotlib
- name: PYTHONUNBUFFERED
  value: "1"
{{- if $root.Values.auth.enabled }}
- name: SPECD_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "specd.authSecretName" $root }}
      key: {{ include "specd.authSecretKey" $root }}
{{- end }}
{{- if .withRedis }}
{{- include "specd.redisEnv" $root }}
{{- end }}
{{- include "specd.distributedEnv" . }}
{{- with (index $root.Values .component).env }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* SPECD_REDIS_URL: from the external Secret, as given, or built for the in-chart Redis with its
password from the release's Secret (Kubernetes expands $(SPECD_REDIS_PASSWORD)). */}}
{{- define "specd.redisEnv" -}}
{{- if .Values.redis.external.existingSecret }}
- name: SPECD_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.existingSecret }}
      key: {{ .Values.redis.external.existingSecretKey }}
{{- else if .Values.redis.external.url }}
- name: SPECD_REDIS_URL
  value: {{ .Values.redis.external.url | quote }}
{{- else if .Values.redis.internal.enabled }}
- name: SPECD_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "specd.secretName" . }}
      key: redis-password
- name: SPECD_REDIS_URL
  value: {{ printf "redis://:$(SPECD_REDIS_PASSWORD)@%s-redis:%v/0" (include "specd.fullname" .) (int .Values.redis.internal.port) | quote }}
{{- end }}
{{- end }}

{{/* Volumes every specd pod has: /tmp, the models (unless inside the image), /dev/shm (when
"specd.shmSize" gives it a size). */}}
{{- define "specd.commonVolumes" -}}
{{- $root := .root }}
{{- $storage := $root.Values.models.storage -}}
- name: tmp
  emptyDir:
    sizeLimit: 2Gi
{{- if eq $storage.type "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ default (printf "%s-models" (include "specd.fullname" $root)) $storage.pvc.existingClaim }}
    readOnly: true
{{- else if eq $storage.type "hostPath" }}
- name: models
  hostPath:
    path: {{ $storage.hostPath.path }}
    {{- with $storage.hostPath.type }}
    type: {{ . }}
    {{- end }}
{{- else if eq $storage.type "emptyDir" }}
- name: models
  emptyDir:
    sizeLimit: {{ $storage.emptyDir.sizeLimit }}
{{- end }}
{{- with include "specd.shmSize" . }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ . }}
{{- end }}
{{- end }}

{{- define "specd.commonVolumeMounts" -}}
{{- $root := .root -}}
- name: tmp
  mountPath: /tmp
{{- if ne $root.Values.models.storage.type "image" }}
- name: models
  mountPath: {{ $root.Values.models.storage.mountPath }}
  readOnly: true
{{- end }}
{{- if include "specd.shmSize" . }}
- name: shm
  mountPath: /dev/shm
{{- end }}
{{- end }}

{{/* The init container that fills the model volume, when models.populate is enabled. */}}
{{- define "specd.initContainers" -}}
{{- $root := .root }}
{{- $populate := $root.Values.models.populate }}
{{- if $populate.enabled }}
{{- if eq $root.Values.models.storage.type "image" }}
{{- fail "models.populate needs a model volume to fill, but models.storage.type is image: use pvc, hostPath or emptyDir" }}
{{- end }}
{{- if not $populate.command }}
{{- fail "models.populate.enabled is true but models.populate.command is empty: give the command that fills the model volume, e.g. [specd, zoo, build]" }}
{{- end }}
initContainers:
  - name: populate-models
    image: {{ include "specd.image" . }}
    imagePullPolicy: {{ include "specd.imagePullPolicy" . }}
    command:
      {{- toYaml $populate.command | nindent 6 }}
    env:
      - name: HOME
        value: /tmp
      - name: XDG_CACHE_HOME
        value: /tmp/.cache
      - name: MPLCONFIGDIR
        value: /tmp/.matplotlib
      {{- with $populate.env }}
      {{- toYaml . | nindent 6 }}
      {{- end }}
    securityContext:
      {{- include "specd.containerSecurityContext" $root | nindent 6 }}
    volumeMounts:
      - name: tmp
        mountPath: /tmp
      - name: models
        mountPath: {{ $root.Values.models.storage.mountPath }}
{{- end }}
{{- end }}

{{/* Probes on the gRPC port. Startup and readiness ask grpc.health.v1 for the overall status ""
(no service name): NOT_SERVING while the weights load and while draining, so a pod receives
traffic only when it can serve it. Liveness must not use that status (a loading or draining pod
would be killed), so it only checks that the port accepts connections. */}}
{{- define "specd.probes" -}}
{{- $probes := (index .root.Values .component).probes -}}
startupProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ $probes.startup.periodSeconds }}
  failureThreshold: {{ $probes.startup.failureThreshold }}
  timeoutSeconds: 5
readinessProbe:
  grpc:
    port: {{ .port }}
  periodSeconds: {{ $probes.readiness.periodSeconds }}
  failureThreshold: {{ $probes.readiness.failureThreshold }}
  timeoutSeconds: 5
livenessProbe:
  tcpSocket:
    port: {{ .port }}
  periodSeconds: {{ $probes.liveness.periodSeconds }}
  failureThreshold: {{ $probes.liveness.failureThreshold }}
  timeoutSeconds: 5
{{- end }}

{{/* Pod-spec fields every role shares: service account, security, scheduling. */}}
{{- define "specd.podSpecCommon" -}}
{{- $root := .root }}
{{- $role := index $root.Values .component -}}
serviceAccountName: {{ include "specd.serviceAccountName" $root }}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ $role.terminationGracePeriodSeconds }}
securityContext:
  {{- include "specd.podSecurityContext" $root | nindent 2 }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with $role.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $role.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Pod template metadata: labels and checksums that roll the pods when their settings change. */}}
{{- define "specd.podMetadata" -}}
{{- $root := .root }}
{{- $role := index $root.Values .component -}}
labels:
  {{- include "specd.componentLabels" . | nindent 2 }}
  {{- with $role.podLabels }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
annotations:
  checksum/config: {{ include "specd.roleConfig" . | sha256sum }}
  checksum/secret: {{ toJson (list $root.Values.auth $root.Values.redis) | sha256sum }}
  {{- with $role.podAnnotations }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}

{{/* Addresses. */}}
{{- define "specd.drafterAddress" -}}
{{- printf "dns:///%s-drafter.%s.svc.%s:%v" (include "specd.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.drafter.port) }}
{{- end }}

{{- define "specd.verifierScoreAddress" -}}
{{- printf "dns:///%s-verifier-headless.%s.svc.%s:%v" (include "specd.fullname" .) .Release.Namespace .Values.clusterDomain (int .Values.verifier.port) }}
{{- end }}

{{- define "specd.trainerAddress" -}}
{{- printf "%s-trainer:%v" (include "specd.fullname" .) (int .Values.trainer.port) }}
{{- end }}

{{/* A NetworkPolicy peer: the release's pods of one component. */}}
{{- define "specd.podPeer" -}}
- podSelector:
    matchLabels:
      {{- include "specd.componentSelectorLabels" . | nindent 6 }}
{{- end }}

{{/*
Multi-process pods. A verifier replica with tensorParallel N, or the trainer with dataParallel N,
is N processes in one pod, one per GPU, started by torchrun (rank 0 serves gRPC/HTTP, so probes
and Services are unchanged). "specd.processes" is N for a role (1 for the drafter).
*/}}
{{- define "specd.processes" -}}
{{- $role := index .root.Values .component }}
{{- if eq .component "verifier" }}{{ int $role.tensorParallel }}
{{- else if eq .component "trainer" }}{{ int $role.dataParallel }}
{{- else }}1{{ end }}
{{- end }}

{{/* The values key that sets a role's process count, for messages. */}}
{{- define "specd.processesKey" -}}
{{- if eq .component "verifier" }}verifier.tensorParallel{{ else }}trainer.dataParallel{{ end }}
{{- end }}

{{/* The container's command: `python -m services.<role>` for one process; for N, torchrun on one
node (--standalone: a local rendezvous on a free port) with N processes. On SIGTERM torchrun
passes the signal to every rank and, after --shutdown-timeout, kills them; that is set to the
pod's grace period so torchrun never cuts a drain short (its default, 30 s, is shorter than the
verifier's two drain phases). The role's flag (--tensor-parallel / --data-parallel) goes first
in `args` ("specd.parallelArgs"). */}}
{{- define "specd.command" -}}
{{- $role := index .root.Values .component }}
{{- $processes := include "specd.processes" . | int }}
{{- if gt $processes 1 -}}
[torchrun, --nproc-per-node, {{ $processes | quote }}, --standalone, --shutdown-timeout, {{ int $role.terminationGracePeriodSeconds | quote }}, -m, services.{{ .component }}]
{{- else -}}
[python, -m, services.{{ .component }}]
{{- end }}
{{- end }}

{{- define "specd.parallelArgs" -}}
{{- $processes := include "specd.processes" . | int }}
{{- if and (gt $processes 1) (eq .component "verifier") -}}
- --tensor-parallel={{ $processes }}
{{- else if and (gt $processes 1) (eq .component "trainer") -}}
- --data-parallel={{ $processes }}
{{- end }}
{{- end }}

{{/* The role's resources as given, except the GPU count: a role that uses GPUs (an
nvidia.com/gpu entry in its requests or limits; null removes one) gets one per process. A count
the values give must be 1 (the default: one process, one GPU) or the process count already. */}}
{{- define "specd.resources" -}}
{{- $role := index .root.Values .component }}
{{- $processes := include "specd.processes" . | int }}
{{- $resources := deepCopy (default dict $role.resources) }}
{{- $gpu := "nvidia.com/gpu" }}
{{- $uses := false }}
{{- range $kind := list "requests" "limits" }}
{{- $given := index $resources $kind | default dict }}
{{- if hasKey $given $gpu }}
{{- $uses = true }}
{{- $count := index $given $gpu | int }}
{{- if and (ne $count 1) (ne $count $processes) }}
{{- fail (printf "%s.resources.%s[%s] is %v but %s is %d: the pod gets one GPU per process, set by %s; leave the count at 1 (or remove it for no GPUs)" $.component $kind $gpu (index $given $gpu) (include "specd.processesKey" $) $processes (include "specd.processesKey" $)) }}
{{- end }}
{{- end }}
{{- end }}
{{- if $uses }}
{{- $limits := index $resources "limits" | default dict }}
{{- $_ := set $limits $gpu $processes }}
{{- $_ := set $resources "limits" $limits }}
{{- with index $resources "requests" }}{{ if hasKey . $gpu }}{{ $_ := set . $gpu $processes }}{{ end }}{{ end }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* Size of the role's memory-backed /dev/shm: its shmSize, else distributed.shmSize for a
multi-process pod (NCCL's intra-node transport and torch.distributed need far more than the
container runtime's 64 MiB), else "" (none). */}}
{{- define "specd.shmSize" -}}
{{- $role := index .root.Values .component }}
{{- if $role.shmSize }}{{ $role.shmSize }}
{{- else if gt (include "specd.processes" . | int) 1 }}{{ .root.Values.distributed.shmSize }}
{{- end }}
{{- end }}

{{/* distributed.env for a multi-process pod, except names the role's `env` sets itself. */}}
{{- define "specd.distributedEnv" -}}
{{- $role := index .root.Values .component }}
{{- if gt (include "specd.processes" . | int) 1 }}
{{- $own := list }}
{{- range $role.env }}{{ $own = append $own .name }}{{ end }}
{{- range $name, $value := .root.Values.distributed.env }}
{{- if and (not (has $name $own)) (not (kindIs "invalid" $value)) }}
- name: {{ $name }}
  value: {{ include "specd.envText" $value | quote }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
