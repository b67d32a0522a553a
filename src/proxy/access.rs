//! Who may use the proxy: client API keys, and the admin token that management calls need.

use pingora_http::RequestHeader;
use subtle::ConstantTimeEq;

use crate::config::{ApiKey, Config};

/// The token of an `Authorization: Bearer <token>` header, as OpenAI clients (and Ollama
/// clients behind an authenticating proxy) send it.
pub fn bearer(req: &RequestHeader) -> Option<&str> {
    req.headers
        .get(http::header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// Compares secrets in time that does not depend on where they differ.
pub fn same_secret(given: &str, expected: &str) -> bool {
    given.as_bytes().ct_eq(expected.as_bytes()).into()
}

/// Whether the request carries one of the configured client keys (always, when none are).
pub fn client_allowed(config: &Config, req: &RequestHeader) -> bool {
    if config.api_keys.is_empty() {
        return true;
    }
    client_key(config, req).is_some()
}

/// The configured key the request carries, if any. Every key is compared, so the time taken
/// does not tell which one matched.
pub fn client_key<'c>(config: &'c Config, req: &RequestHeader) -> Option<&'c ApiKey> {
    // Anthropic's clients send their key in `x-api-key`.
    let given = bearer(req).or_else(|| {
        req.headers
            .get("x-api-key")
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    })?;
    config
        .api_keys
        .iter()
        .fold(None, |found, key| match same_secret(given, key.secret()) {
            true => found.or(Some(key)),
            false => found,
        })
}

/// Whether a management call carries the admin token in `X-Fleet-Admin-Token`.
pub fn admin_allowed(config: &Config, req: &RequestHeader) -> bool {
    let Some(token) = &config.admin_token else {
        return false;
    };
    req.headers
        .get("x-fleet-admin-token")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|given| same_secret(given, token))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client_name(config: &Config, req: &RequestHeader) -> String {
        super::super::clients::identify(config, req, None).name
    }

    fn req(headers: &[(&str, &str)]) -> RequestHeader {
        let mut r = RequestHeader::build("POST", b"/api/chat", None).unwrap();
        for (k, v) in headers {
            r.insert_header(k.to_string(), *v).unwrap();
        }
        r
    }

    #[test]
    fn keys_are_checked_only_when_configured() {
        let mut config = Config::default();
        assert!(client_allowed(&config, &req(&[])));
        config.api_keys = vec!["k1".into(), "k2".into()];
        assert!(!client_allowed(&config, &req(&[])));
        assert!(!client_allowed(
            &config,
            &req(&[("authorization", "Bearer k3")])
        ));
        assert!(client_allowed(
            &config,
            &req(&[("authorization", "Bearer k2")])
        ));
        assert!(!client_allowed(&config, &req(&[("authorization", "k2")])));
        assert_eq!(
            client_name(&config, &req(&[("authorization", "Bearer k2")])),
            "anonymous"
        );
    }

    #[test]
    fn named_keys_name_their_client() {
        let config: Config = serde_yaml::from_str(
            "api_keys: [plain, {name: team-a, key: ka}, {name: team-b, key: kb}]",
        )
        .unwrap();
        config.validate().unwrap();
        let name = |h: &str| client_name(&config, &req(&[("authorization", h)]));
        assert_eq!(name("Bearer ka"), "team-a");
        assert_eq!(name("Bearer kb"), "team-b");
        assert_eq!(name("Bearer plain"), "anonymous");
        let anthropic = req(&[("x-api-key", "kb")]);
        assert_eq!(client_name(&config, &anthropic), "team-b");
        assert_eq!(name("Bearer nope"), "anonymous");
        assert!(client_allowed(
            &config,
            &req(&[("authorization", "Bearer kb")])
        ));
        let twice: Config =
            serde_yaml::from_str("api_keys: [{name: a, key: x}, {name: a, key: y}]").unwrap();
        assert!(twice.validate().unwrap_err().contains("used twice"));
        let anon: Config = serde_yaml::from_str("api_keys: [{name: anonymous, key: x}]").unwrap();
        assert!(anon.validate().is_err());
    }

    #[test]
    fn management_needs_the_admin_token() {
        let mut config = Config::default();
        let with = req(&[("x-fleet-admin-token", "t")]);
        assert!(!admin_allowed(&config, &with), "no token configured: never");
        config.admin_token = Some("t".into());
        assert!(admin_allowed(&config, &with));
        assert!(!admin_allowed(
            &config,
            &req(&[("x-fleet-admin-token", "u")])
        ));
        assert!(
            same_secret("abc", "abc") && !same_secret("abc", "abd") && !same_secret("ab", "abc")
        );
    }
}
