//! Wall-clock timestamps in the formats Ollama and OpenAI use, without a date-time crate.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The fixed `modified_at` / `created` of every model on disk, so listings are deterministic.
pub const MODELS_MODIFIED: u64 = 1_735_689_600; // 2025-01-01T00:00:00Z

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Now, as Ollama's `created_at`.
pub fn now_rfc3339() -> String {
    rfc3339(SystemTime::now())
}

/// The wall-clock time of a monotonic instant (for `expires_at`).
pub fn instant_rfc3339(at: Instant) -> String {
    let now = Instant::now();
    let wall = if at >= now {
        SystemTime::now() + (at - now)
    } else {
        SystemTime::now() - (now - at)
    };
    rfc3339(wall)
}

/// A time far enough ahead to mean "never" (what Ollama shows for `keep_alive: -1`).
pub fn far_future_rfc3339() -> String {
    rfc3339(SystemTime::now() + Duration::from_secs(100 * 365 * 86_400))
}

/// `2024-06-04T14:38:31.837530000Z`: RFC 3339 in UTC with nanoseconds.
pub fn rfc3339(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (year, month, day) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:09}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        since.subsec_nanos()
    )
}

/// Days since 1970-01-01 to (year, month, day), after Howard Hinnant's `civil_from_days`.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00.000000000Z");
        let t = UNIX_EPOCH + Duration::new(MODELS_MODIFIED, 5);
        assert_eq!(rfc3339(t), "2025-01-01T00:00:00.000000005Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400 + 3661); // 2000-02-29
        assert_eq!(rfc3339(leap), "2000-02-29T01:01:01.000000000Z");
    }
}
