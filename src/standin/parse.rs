//! Reading request bodies the way Ollama does: tolerant of unknown fields and key order,
//! strict about a missing model, and with Ollama's flexible `keep_alive`.

use std::time::Duration;

use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::error::StandinError;
use super::residency::KeepAlive;

/// Ollama's `options` object; only the fields that change the stand-in's behaviour.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct Options {
    pub num_predict: Option<i64>,
    pub num_ctx: Option<i64>,
}

impl Options {
    /// A positive `num_ctx`, if given.
    pub fn context(&self) -> Option<u32> {
        self.num_ctx
            .filter(|&n| n > 0)
            .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
    }
}

/// Parses a JSON body; malformed JSON is a 400 with the parser's message.
pub fn json_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, StandinError> {
    serde_json::from_slice(body).map_err(|e| StandinError::bad_request(e.to_string()))
}

/// The request's model name, which every model endpoint needs.
pub fn required_model(model: Option<String>) -> Result<String, StandinError> {
    model
        .filter(|m| !m.is_empty())
        .ok_or_else(|| StandinError::bad_request("model is required"))
}

/// Ollama's `keep_alive`: a number of seconds or a Go duration string (`"5m"`, `"1h30m"`,
/// `"-1"`); any negative value means forever.
pub fn keep_alive(value: Option<&Value>) -> Result<Option<KeepAlive>, StandinError> {
    let seconds = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Number(n)) => n.as_f64(),
        Some(Value::String(s)) => go_duration_seconds(s.trim()),
        Some(_) => None,
    };
    let invalid = || StandinError::bad_request("invalid keep_alive");
    let seconds = seconds.ok_or_else(invalid)?;
    Ok(Some(if seconds < 0.0 {
        KeepAlive::Forever
    } else {
        // NaN, infinity and durations past u64 seconds are refused, not panicked on.
        KeepAlive::For(Duration::try_from_secs_f64(seconds).map_err(|_| invalid())?)
    }))
}

/// `"90"`, `"1.5s"`, `"5m"`, `"1h30m"`, `"-1m"`, `"250ms"` in seconds.
fn go_duration_seconds(s: &str) -> Option<f64> {
    if let Ok(plain) = s.parse::<f64>() {
        return Some(plain);
    }
    let (sign, mut rest) = match s.strip_prefix('-') {
        Some(r) => (-1.0, r),
        None => (1.0, s),
    };
    let mut total = 0.0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..digits].parse().ok()?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        total += number * unit_seconds(&rest[..unit_len])?;
        rest = &rest[unit_len..];
    }
    Some(sign * total)
}

fn unit_seconds(unit: &str) -> Option<f64> {
    Some(match unit {
        "h" => 3600.0,
        "m" => 60.0,
        "s" => 1.0,
        "ms" => 1e-3,
        "us" | "µs" => 1e-6,
        "ns" => 1e-9,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ka(v: Value) -> Option<KeepAlive> {
        keep_alive(Some(&v)).ok().flatten()
    }

    #[test]
    fn keep_alive_accepts_ollama_forms() {
        let secs = |s| Some(KeepAlive::For(Duration::from_secs(s)));
        assert_eq!(ka(json!(30)), secs(30));
        assert_eq!(ka(json!("5m")), secs(300));
        assert_eq!(ka(json!("1h30m")), secs(5400));
        assert_eq!(ka(json!("0")), secs(0));
        assert_eq!(ka(json!(-1)), Some(KeepAlive::Forever));
        assert_eq!(ka(json!("-1m")), Some(KeepAlive::Forever));
        assert!(keep_alive(Some(&json!("soon"))).is_err());
        assert_eq!(keep_alive(None).ok().flatten(), None);
    }

    #[test]
    fn keep_alive_out_of_range_is_a_bad_request_not_a_panic() {
        for v in [json!("inf"), json!("NaN"), json!(1e30)] {
            assert!(keep_alive(Some(&v)).is_err(), "{v}");
        }
        // Within Duration's range but past the clock's: never expires.
        let r = ka(json!(1e19));
        let Some(KeepAlive::For(d)) = r else {
            panic!("{r:?}")
        };
        assert_eq!(std::time::Instant::now().checked_add(d), None);
    }

    #[test]
    fn missing_model_is_a_bad_request() {
        assert!(required_model(None).is_err());
        assert!(required_model(Some(String::new())).is_err());
        assert_eq!(required_model(Some("m".into())).ok().as_deref(), Some("m"));
    }
}
