//! Trust for `https://` nodes. Without `nodes[].ca_file` a node's certificate is checked
//! against the system's roots (Pingora's connector loads them, honouring `SSL_CERT_FILE` and
//! `SSL_CERT_DIR`); with it, against the system's roots plus that file's certificates, so a
//! lab's self-signed certificate works without turning verification off.

use std::panic::AssertUnwindSafe;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use pingora_core::protocols::tls::CaType;
use pingora_core::tls::CertificateDer;
use pingora_core::utils::tls::{WrappedX509, parse_x509};
use rustls_pki_types::pem::PemObject;

/// The roots a node with this CA file is checked against.
pub fn roots_with(ca_file: &Path) -> Result<Arc<CaType>, String> {
    let shown = ca_file.display();
    let mut roots: Vec<Vec<u8>> = system_roots().to_vec();
    let mut added = 0;
    let certs = CertificateDer::pem_file_iter(ca_file)
        .map_err(|e| format!("cannot read CA file {shown}: {e}"))?;
    for cert in certs {
        let cert = cert.map_err(|e| format!("CA file {shown}: {e}"))?;
        if !parses(cert.as_ref()) {
            return Err(format!("CA file {shown}: a certificate does not parse"));
        }
        roots.push(cert.as_ref().to_vec());
        added += 1;
    }
    if added == 0 {
        return Err(format!("CA file {shown}: no PEM certificate in it"));
    }
    let roots: Vec<WrappedX509> = roots
        .into_iter()
        .map(|der| WrappedX509::new(der, parse_x509))
        .collect();
    Ok(Arc::from(roots))
}

/// The system's roots, read once, keeping only those Pingora's certificate type can hold.
fn system_roots() -> &'static [Vec<u8>] {
    static ROOTS: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    ROOTS.get_or_init(|| match pingora_core::tls::load_native_certs() {
        Ok(certs) => certs
            .iter()
            .map(|c| c.as_ref().to_vec())
            .filter(|der| parses(der))
            .collect(),
        Err(e) => {
            log::warn!("system CA certificates not read: {e}; only nodes[].ca_file is trusted");
            Vec::new()
        }
    })
}

/// Whether Pingora's wrapper takes this certificate: its parser panics on what it cannot
/// read, and a configuration must never take the process down.
fn parses(der: &[u8]) -> bool {
    let der = der.to_vec();
    std::panic::catch_unwind(AssertUnwindSafe(|| {
        drop(WrappedX509::new(der, parse_x509));
    }))
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_without_certificates_is_refused_with_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let err = roots_with(&path).unwrap_err();
        assert!(err.contains("empty.pem") && err.contains("no PEM"), "{err}");
        let err = roots_with(&dir.path().join("missing.pem")).unwrap_err();
        assert!(err.contains("cannot read CA file"), "{err}");
    }
}
