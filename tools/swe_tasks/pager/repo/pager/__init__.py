from pager.core import page_count, paginate
