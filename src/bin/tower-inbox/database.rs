//! The connection, and the failures that end a command with its exit code.

use std::fmt;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;
use tower_inbox::schema::{Layout, Schema};

/// Why a command did not do what it was asked, and its exit code.
#[derive(Debug)]
pub enum Failure {
    /// Exit 1: the request is understood and refused (unknown ID, already decided).
    Refused(String),
    /// Exit 2: the command line is wrong.
    Usage(String),
    /// Exit 3: the database cannot be reached or used.
    Database(String),
    /// Exit 130, as for any program stopped by Ctrl-C: what it did is printed already.
    Interrupted,
}

impl Failure {
    pub fn code(&self) -> u8 {
        match self {
            Self::Refused(_) => 1,
            Self::Usage(_) => 2,
            Self::Database(_) => 3,
            Self::Interrupted => 130,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Refused(why) | Self::Usage(why) | Self::Database(why) => f.write_str(why),
            Self::Interrupted => f.write_str("interrupted: the batches before it are committed"),
        }
    }
}

/// The pool and the schema every command works in.
pub struct Database {
    pub pool: PgPool,
    pub schema: Schema,
    target: Target,
}

impl Database {
    /// A database error of `what` as one line naming the server.
    pub fn failure(&self, what: &str, err: impl fmt::Display) -> Failure {
        self.target.failure(what, err)
    }

    /// The layout of the schema's inbox in the database; `None` when it has none yet.
    pub async fn detected_layout(&self) -> Result<Option<Layout>, Failure> {
        Layout::detect(&self.pool, &self.schema)
            .await
            .map_err(|e| self.failure("reading the inbox's layout from", e))
    }
}

/// A layout as the command line names it (`--layout`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LayoutArg {
    /// One table each.
    #[default]
    Plain,
    /// The inbox partitioned by time (README, "Partitioned inbox").
    Partitioned,
}

impl From<LayoutArg> for Layout {
    fn from(arg: LayoutArg) -> Self {
        match arg {
            LayoutArg::Plain => Self::Plain,
            LayoutArg::Partitioned => Self::Partitioned,
        }
    }
}

/// The server as errors name it, and the password to keep out of them.
struct Target {
    name: String,
    password: Option<String>,
}

impl Target {
    /// One line naming the server, with the password taken out should the server or the
    /// driver ever echo it.
    fn failure(&self, what: &str, err: impl fmt::Display) -> Failure {
        // One line, whatever the server or a migration's exception put in its text.
        let mut message = format!("{what} {}: {err}", self.name).replace('\n', " ");
        if let Some(password) = self.password.as_deref().filter(|p| !p.is_empty()) {
            for form in [password.to_owned(), url::percent_decoded(password)] {
                message = message.replace(&form, "***");
            }
        }
        Failure::Database(message)
    }
}

/// Connects to the URL (from `origin`, the flag or the variable), within 10 s.
pub async fn connect(url: Option<&str>, origin: &str, schema: &str) -> Result<Database, Failure> {
    let url = url.ok_or_else(|| {
        Failure::Usage("no database: pass --database-url or set DATABASE_URL".to_owned())
    })?;
    let schema =
        Schema::new(schema).map_err(|e| Failure::Usage(format!("--schema {schema:?}: {e}")))?;
    // The URL is not echoed: it may hold the password.
    let options: PgConnectOptions = url.parse().map_err(|_| {
        Failure::Usage(format!(
            "the database URL from {origin} is not a PostgreSQL URL"
        ))
    })?;
    let target = Target {
        name: format!(
            "PostgreSQL at {}:{} (URL from {origin})",
            options.get_host(),
            options.get_port()
        ),
        password: url::password_of(url),
    };
    let pool = PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(options.application_name("tower-inbox-cli"))
        .await
        .map_err(|err| target.failure("cannot connect to", err))?;
    Ok(Database {
        pool,
        schema,
        target,
    })
}

mod url {
    /// The password of `scheme://user:password@host/...` (the userinfo ends at the last
    /// `@`) or of a `password=` parameter, as written and percent-decoded: every form that
    /// could be echoed, to keep out of messages.
    pub fn password_of(url: &str) -> Option<String> {
        let rest = url.split_once("://")?.1;
        let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
        let from_userinfo = before_query
            .rsplit_once('@')
            .and_then(|(userinfo, _)| userinfo.split_once(':'))
            .map(|(_, password)| password);
        let from_query = query
            .split('&')
            .find_map(|pair| pair.strip_prefix("password="));
        from_userinfo.or(from_query).map(str::to_owned)
    }

    /// `%XX` sequences decoded; anything malformed left as it is.
    pub fn percent_decoded(text: &str) -> String {
        let bytes = text.as_bytes();
        let mut out = Vec::with_capacity(bytes.len());
        let mut i = 0;
        while i < bytes.len() {
            let hex = |b: u8| (b as char).to_digit(16);
            match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
                (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                    out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                    i += 3;
                }
                (b, _, _) => {
                    out.push(b);
                    i += 1;
                }
            }
        }
        String::from_utf8_lossy(&out).into_owned()
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn the_password_is_found_to_be_hidden() {
            let p = super::password_of;
            assert_eq!(p("postgres://u:s3cret@h:5432/d").as_deref(), Some("s3cret"));
            assert_eq!(p("postgres://u:a@b@h/d").as_deref(), Some("a@b"));
            assert_eq!(p("postgres://u@h/d?password=pw&x=1").as_deref(), Some("pw"));
            assert_eq!(p("postgres://u@h/d"), None);
            assert_eq!(p("postgres://h/d"), None);
            assert_eq!(super::percent_decoded("p%40ss%zz"), "p@ss%zz");
        }
    }
}
