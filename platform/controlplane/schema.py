"""How the OpenAPI schema describes the control plane's own authentication schemes."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.accounts.authentication.ApiKeyAuthentication"
    name = "apiKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "a key from 'manage.py create_api_key'"}


class NodeCredentialScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.nodes.authentication.NodeCredentialAuthentication"
    name = "nodeCredential"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": "Authorization",
            "description": "'Node <node id>:<credential>', as stored by the agent at enrollment",
        }
