{{/* Names, labels, images and the shared environment of the kernelctl chart. */}}

{{- define "kernelctl.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kernelctl.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kernelctl.controllerName" -}}
{{- printf "%s-controller" (include "kernelctl.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kernelctl.agentName" -}}
{{- printf "%s-agent" (include "kernelctl.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kernelctl.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "kernelctl.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kernelctl
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* selectorLabels: pass (dict "ctx" $ "component" "controller") */}}
{{- define "kernelctl.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kernelctl.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* image: pass (dict "image" .Values.controller.image "ctx" $) */}}
{{- define "kernelctl.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "kernelctl.controllerServiceAccountName" -}}
{{- if .Values.controller.serviceAccount.create -}}
{{- default (include "kernelctl.controllerName" .) .Values.controller.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.controller.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kernelctl.agentServiceAccountName" -}}
{{- if .Values.agent.serviceAccount.create -}}
{{- default (include "kernelctl.agentName" .) .Values.agent.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.agent.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kernelctl.agentPriorityClassName" -}}
{{- default (include "kernelctl.agentName" .) .Values.agent.priorityClass.name -}}
{{- end -}}

{{/* Secret names */}}
{{- define "kernelctl.databaseSecretName" -}}
{{- printf "%s-database" (include "kernelctl.fullname" .) -}}
{{- end -}}

{{- define "kernelctl.authSecretName" -}}
{{- default (printf "%s-auth" (include "kernelctl.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{- define "kernelctl.trustedKeysSecretName" -}}
{{- default (printf "%s-trusted-keys" (include "kernelctl.fullname" .)) .Values.trustedKeys.existingSecret -}}
{{- end -}}

{{- define "kernelctl.profileConfigMapName" -}}
{{- default (printf "%s-profile" (include "kernelctl.fullname" .)) .Values.agent.profile.existingConfigMap -}}
{{- end -}}

{{- define "kernelctl.controllerUrl" -}}
{{- if .Values.agent.controllerUrl -}}
{{- .Values.agent.controllerUrl -}}
{{- else -}}
{{- printf "http://%s.%s.svc:%d" (include "kernelctl.controllerName" .) .Release.Namespace (int .Values.controller.service.port) -}}
{{- end -}}
{{- end -}}

{{/* True when the chart must create the database password Secret. */}}
{{- define "kernelctl.createDatabaseSecret" -}}
{{- if and (not .Values.database.urlSecret.name) (not .Values.database.external.existingSecret) .Values.database.external.password -}}
true
{{- end -}}
{{- end -}}

{{/*
Database environment shared by the controller and the migrations job. Either KERNELCTL_DATABASE_URL from
the URL Secret, or a URL built from the external settings with the password in PGPASSWORD (libpq reads it).
*/}}
{{- define "kernelctl.databaseEnv" -}}
{{- $db := .Values.database -}}
{{- if $db.urlSecret.name }}
- name: KERNELCTL_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $db.urlSecret.name }}
      key: {{ $db.urlSecret.key }}
{{- else }}
{{- $ext := $db.external }}
{{- if not $ext.host }}
{{- fail "database.external.host is empty: set it (or database.urlSecret.name for a full URL Secret)" }}
{{- end }}
{{- if $ext.existingSecret }}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $ext.existingSecret }}
      key: {{ $ext.existingSecretPasswordKey }}
{{- else if $ext.password }}
- name: PGPASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "kernelctl.databaseSecretName" . }}
      key: password
{{- end }}
{{- $host := ternary (printf "[%s]" $ext.host) $ext.host (contains ":" $ext.host) }}
- name: KERNELCTL_DATABASE_URL
  value: {{ printf "postgresql+psycopg://%s@%s:%d/%s?sslmode=%s" (urlquery $ext.user | replace "+" "%20") $host (int $ext.port) (urlquery $ext.database | replace "+" "%20") $ext.sslmode | quote }}
{{- end }}
- name: KERNELCTL_LOG_LEVEL
  value: {{ .Values.log.level | quote }}
- name: KERNELCTL_LOG_FORMAT
  value: {{ .Values.log.format | quote }}
{{- end -}}

{{/* Writable scratch for a read-only root filesystem. */}}
{{- define "kernelctl.scratchEnv" -}}
- name: HOME
  value: /tmp
- name: TMPDIR
  value: /tmp
- name: PYTHONDONTWRITEBYTECODE
  value: "1"
- name: PYTHONUNBUFFERED
  value: "1"
{{- end -}}

{{/* Cross-field checks the JSON schema cannot express; called from the controller Deployment. */}}
{{- define "kernelctl.validate" -}}
{{- $pdb := .Values.controller.podDisruptionBudget -}}
{{- if and $pdb.enabled (ge (int $pdb.minAvailable) (int .Values.controller.replicas)) -}}
{{- fail (printf "controller.podDisruptionBudget.minAvailable (%d) must be below controller.replicas (%d), or no node could ever be drained" (int $pdb.minAvailable) (int .Values.controller.replicas)) -}}
{{- end -}}
{{- if and .Values.database.urlSecret.name (or .Values.database.external.password .Values.database.external.existingSecret) -}}
{{- fail "set either database.urlSecret.name (full URL Secret) or database.external.password/existingSecret, not both" -}}
{{- end -}}
{{- if and .Values.database.external.password .Values.database.external.existingSecret -}}
{{- fail "set either database.external.password or database.external.existingSecret, not both" -}}
{{- end -}}
{{- if and .Values.auth.existingSecret (or .Values.auth.tokens .Values.auth.agentToken) -}}
{{- fail "set either auth.existingSecret or auth.tokens/auth.agentToken, not both" -}}
{{- end -}}
{{- if and .Values.trustedKeys.existingSecret .Values.trustedKeys.keys -}}
{{- fail "set either trustedKeys.existingSecret or trustedKeys.keys, not both" -}}
{{- end -}}
{{- if and .Values.agent.profile.existingConfigMap .Values.agent.profile.content -}}
{{- fail "set either agent.profile.existingConfigMap or agent.profile.content, not both" -}}
{{- end -}}
{{- end -}}
