//! The command line as a user meets it: the flags `--help` lists, checking a configuration
//! with `-t`, and the errors corral gives at start instead of running.

use std::process::{Command, Output};

fn corral(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_corral"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("corral runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Runs corral with `flags` and `-c` a file holding `yaml`; returns its output and the path.
fn corral_with_config(yaml: &str, flags: &[&str]) -> (Output, String) {
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp file");
    std::fs::write(file.path(), yaml).expect("config written");
    let path = file.path().to_str().expect("utf-8 path").to_string();
    let args: Vec<&str> = flags.iter().copied().chain(["-c", path.as_str()]).collect();
    (corral(&args), path)
}

#[test]
fn help_lists_each_server_flag_with_what_it_does() {
    let out = corral(&["--help"]);
    assert!(out.status.success(), "{out:?}");
    let help = text(&out.stdout);
    for (flag, says) in [
        ("-c, --conf <FILE>", "The configuration file"),
        ("-t, --test", "Check the configuration and exit"),
        ("-d, --daemon", "Run in the background"),
        ("-u, --upgrade", "graceful upgrade"),
    ] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(flag))
            .unwrap_or_else(|| panic!("no {flag} in:\n{help}"));
        assert!(line.contains(says), "{flag} says: {line}");
    }
    // Pingora's own `Opt` labels -u with its struct's description.
    assert!(
        !help.contains("base set of command line arguments"),
        "{help}"
    );
}

#[test]
fn test_flag_accepts_a_valid_configuration_and_exits() {
    let (out, _) = corral_with_config(
        "threads: 1\nnodes:\n  - {name: a, url: 'http://127.0.0.1:1'}\n  - {name: b, url: 'http://127.0.0.1:2'}\n",
        &["-t"],
    );
    assert!(out.status.success(), "{out:?}");
    assert!(
        text(&out.stdout).contains("configuration is valid (2 nodes)"),
        "{out:?}"
    );
}

#[test]
fn test_flag_names_the_bad_key_and_fails() {
    let (out, path) = corral_with_config(
        "nodes:\n  - {name: a, url: 'http://127.0.0.1:1'}\nweights:\n  model_loded: 3\n",
        &["-t"],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = text(&out.stderr);
    assert!(
        err.contains(&format!(
            "corral: config {path}: weights.model_loded: unknown field `model_loded`"
        )),
        "{err}"
    );
    assert!(text(&out.stdout).is_empty(), "{out:?}");
}

#[test]
fn a_bad_value_is_named_by_where_it_is() {
    let (out, _) = corral_with_config(
        "nodes:\n  - {name: a, url: 'http://127.0.0.1:1'}\n  - {name: b, url: 'http://127.0.0.1:2', num_parallel: two}\n",
        &[],
    );
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = text(&out.stderr);
    assert!(err.contains("nodes[1].num_parallel: invalid type"), "{err}");
}

#[test]
fn without_nodes_it_says_how_to_give_some() {
    let out = corral(&[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = text(&out.stderr);
    assert!(
        err.contains("no nodes configured: pass -c conf/corral.yaml"),
        "{err}"
    );
    if cfg!(feature = "demo") {
        assert!(err.contains("corral demo"), "{err}");
    }
}

#[test]
fn a_missing_file_is_named() {
    let out = corral(&["-c", "/nonexistent/corral.yaml"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot read config /nonexistent/corral.yaml"),
        "{err}"
    );
}

#[test]
fn an_address_another_server_holds_is_named_and_corral_exits() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let address = taken.local_addr().expect("its address");
    let file = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp file");
    let yaml = format!(
        "listen: {address}\nmetrics_listen: null\nadmin_listen: null\n\
         nodes:\n  - {{name: a, url: 'http://127.0.0.1:1'}}\n"
    );
    std::fs::write(file.path(), yaml).expect("config written");
    let mut child = Command::new(env!("CARGO_BIN_EXE_corral"))
        .arg("-c")
        .arg(file.path())
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("corral runs");
    // Bounded: a corral that retries the address (as Pingora does) is stopped and fails this.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let status = loop {
        if let Some(status) = child.try_wait().expect("corral's status") {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("corral still running 10 s after starting on {address}, which is taken");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let out = child.wait_with_output().expect("corral's output");
    assert_eq!(status.code(), Some(2), "{out:?}");
    let says = text(&out.stderr);
    assert!(
        says.contains(&format!("listen: cannot listen on {address}")),
        "{says}"
    );
}
